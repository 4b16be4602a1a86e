"""Compile `cpu_kernels.c` (and the parts under `cpu/` it includes) once per machine with
the system C compiler and load it.

One source, several variants (`VARIANTS`): the same C compiled with the flags of an
instruction-set target. At load the widest variant whose CPU features the host has (read
from /proc/cpuinfo, i.e. cpuid) is chosen; `LOOM_CPU_KERNEL_VARIANT=<name>` picks a
narrower one, and `use_variant` switches within a process (tests run every kernel test on
each variant the host can execute). Every variant computes the same bits: the integer sums
of w8a8 are exact and every float operation runs in the same order; the VNNI variants
(AVX-512 VNNI, and AVX-VNNI on newer AVX2-only CPUs) do four int8 products and their sum in
one instruction (`vpdpbusd`) where plain AVX2 needs four.

A shared library is cached under `loom_cache_dir("kernels")`, keyed by a hash of the
source, the flags and the compiler, and written atomically so concurrent processes never
load a half-written file. Anything that goes wrong (no compiler, no AVX2/FMA, a failed
build, `LOOM_CPU_KERNELS=0`) leaves the kernels unavailable and Loom on its pure-torch
paths; the reason is kept for `kernel_status()`.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loom.cache_dir import loom_cache_dir
from loom.cpu_features import cpu_flags

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# The parts SOURCE includes (one file per job), compiled with it as one translation unit.
PARTS = Path(__file__).with_name("cpu")


def source_bytes() -> bytes:
    """The kernels' whole source: the unit and every part it includes, in a fixed order (a
    change to any of them is a new build)."""
    files = [SOURCE, *sorted(PARTS.glob("*.[ch]"))]
    return b"".join(f.name.encode() + b"\0" + f.read_bytes() for f in files)
# -mf16c: float16 KV caches (every AVX2 CPU has F16C). -ffp-contract=off: every fused
# multiply-add is an explicit intrinsic, so results do not depend on how the compiler
# contracts the scalar code (batch invariance relies on it).
BASE_FLAGS = (
    "-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
    "-fvisibility=hidden",
)


@dataclass(frozen=True)
class KernelVariant:
    """One instruction-set target of the kernels."""

    name: str
    flags: tuple[str, ...]  # compiler flags beyond BASE_FLAGS
    cpu_features: frozenset[str]  # /proc/cpuinfo flags the host needs to run it


# Widest first: the first variant the host can run is the default. The AVX-512 variant keeps
# 256-bit vectors (the intrinsics are 256-bit; auto-vectorised loops would otherwise use
# 512-bit ones, which lower the clock on some Intel CPUs).
VARIANTS = (
    KernelVariant(
        "avx512-vnni",
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mprefer-vector-width=256"),
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
    ),
    KernelVariant(
        "avx2-vnni", ("-mavxvnni",), frozenset({"avx2", "fma", "f16c", "avx_vnni"}),
    ),
    KernelVariant("avx2", (), frozenset({"avx2", "fma", "f16c"})),
)
VARIANT_ENV = "LOOM_CPU_KERNEL_VARIANT"


def variant_named(name: str) -> KernelVariant:
    """The variant called `name` (ValueError for an unknown name)."""
    for variant in VARIANTS:
        if variant.name == name:
            return variant
    raise ValueError(
        f"unknown CPU kernel variant {name!r}; known: {', '.join(v.name for v in VARIANTS)}"
    )


def runnable_variants(flags: frozenset[str] | None = None) -> list[str]:
    """Names of the variants a CPU with these feature flags (default: this one) executes,
    widest first."""
    flags = cpu_flags() if flags is None else flags
    return [v.name for v in VARIANTS if v.cpu_features <= flags]


_i64, _f32 = ctypes.c_int64, ctypes.c_float
_ptr = ctypes.c_void_p
# Argument types of every exported function (see cpu_kernels.c for the meaning).
SIGNATURES: dict[str, list[type]] = {
    "loom_linear_w8": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr],
    "loom_kernel_variant": [],
    "loom_linear_w8a8_packed": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr],
    "loom_linear_w8a8_ref": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr],
    "loom_linear_f32": [_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr],
    "loom_paged_attention": [
        _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
        _f32, _f32, _ptr, _i64, _ptr, _i64,
    ],
    "loom_rms_norm": [_ptr, _i64, _i64, _ptr, _f32, _f32, _ptr, _ptr],
    "loom_rope_neox": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr],
    "loom_argmax_logsumexp": [_ptr, _i64, _i64, _ptr, _ptr],
    "loom_apply_token_bitmask": [_ptr, _i64, _ptr, _i64, _ptr, _i64],
    "loom_dequantize": [_i64, _ptr, _i64, _ptr],
    "loom_w4a8_pack": [_i64, _ptr, _i64, _i64, _ptr],
    "loom_w4a8_record_bytes": [_i64],
    "loom_w4a8_dequantize": [_i64, _ptr, _i64, _i64, _ptr],
    "loom_w4a8_rows": [_i64, _ptr, _i64, _i64, _ptr, _i64, _ptr],
    "loom_linear_w4a8": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr],
    "loom_linear_w4a8_ref": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr],
    "loom_gated_act": [_ptr, _i64, _i64, ctypes.c_int32, _f32, _f32, _ptr],
    "loom_moe_route": [_ptr, _i64, _i64, _i64, ctypes.c_int32, ctypes.c_int32, _ptr, _ptr],
    "loom_moe_ffn": [_ptr, _ptr, _i64, _ptr],
}
# Functions that return a value (the others return void).
RESTYPES: dict[str, type] = {"loom_kernel_variant": ctypes.c_char_p,
                              "loom_dequantize": ctypes.c_int64,
                              "loom_w4a8_pack": ctypes.c_int64,
                              "loom_w4a8_record_bytes": ctypes.c_int64,
                              "loom_w4a8_dequantize": ctypes.c_int64,
                              "loom_w4a8_rows": ctypes.c_int64}


@dataclass
class _Loaded:
    """The outcome of one build-and-load attempt (one per variant and process)."""

    lib: ctypes.CDLL | None
    reason: str | None  # why `lib` is None
    variant: str | None  # the variant tried


_loaded: dict[str | None, _Loaded] = {}
_active: str | None = None  # set by `use_variant`; None: the default choice


def _default_variants() -> tuple[list[str], str | None]:
    """The variants to try in order (the first that builds is used), or ([], why none can
    run here)."""
    runnable = runnable_variants()
    requested = os.environ.get(VARIANT_ENV)
    if requested:
        try:
            variant_named(requested)
        except ValueError as error:
            return [], f"{VARIANT_ENV}={requested} names no variant ({error})"
        if requested not in runnable:
            return [], f"{VARIANT_ENV}={requested} needs CPU features this host lacks"
        return [requested], None
    if not runnable:
        return [], "the CPU lacks AVX2, FMA or F16C"
    return runnable, None


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def compile_variant(compiler: str, variant: KernelVariant, source: Path, output: Path) -> None:
    """Compile a kernels source file as the variant is built (RuntimeError with the
    compiler's message when it fails)."""
    result = subprocess.run(
        [compiler, *BASE_FLAGS, *variant.flags, str(source), "-o", str(output), "-lm"],
        capture_output=True, text=True, check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")


def compiler_or_fail() -> str:
    """The C compiler Loom builds its kernels with (RuntimeError when there is none)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC)")
    return compiler


def _build(compiler: str, variant: KernelVariant) -> Path:
    """The variant's shared library, compiled unless the cache holds it."""
    flags = (*BASE_FLAGS, *variant.flags)
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    key = hashlib.sha256(
        source_bytes() + " ".join(flags).encode() + version.encode()
    ).hexdigest()[:16]
    target = loom_cache_dir("kernels") / f"loom_cpu_{variant.name}_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        compile_variant(compiler, variant, SOURCE, Path(tmp))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _try_load(name: str | None) -> _Loaded:
    """Build and load variant `name`; None: the widest this host runs, falling back to a
    narrower one when a build fails (a compiler without AVX-512 support, say)."""
    if os.environ.get("LOOM_CPU_KERNELS", "1") == "0":
        return _Loaded(None, "disabled by LOOM_CPU_KERNELS=0", None)
    if name is not None:
        if name not in runnable_variants():
            return _Loaded(None, f"this CPU cannot run the {name} kernels", name)
        return _load_variant(name)
    names, unsupported = _default_variants()
    if not names:
        return _Loaded(None, unsupported, None)
    failures = []
    for candidate in names:
        loaded = _load_variant(candidate)
        if loaded.lib is not None:
            return loaded
        failures.append(f"{candidate}: {loaded.reason}")
    return _Loaded(None, "; ".join(failures), names[-1])


def _load_variant(name: str) -> _Loaded:
    compiler = _compiler()
    if compiler is None:
        return _Loaded(None, "no C compiler (cc, gcc or clang) on PATH", name)
    try:
        lib = ctypes.CDLL(str(_build(compiler, variant_named(name))))
        for fn_name, argtypes in SIGNATURES.items():
            fn = getattr(lib, fn_name)
            fn.argtypes = argtypes
            fn.restype = RESTYPES.get(fn_name)
    except (OSError, RuntimeError, AttributeError) as exc:
        return _Loaded(None, f"build or load failed: {exc}", name)
    return _Loaded(lib, None, name)


def _current() -> _Loaded:
    if _active not in _loaded:
        _loaded[_active] = _try_load(_active)
    return _loaded[_active]


def load_library() -> ctypes.CDLL | None:
    """The compiled kernels of the active variant, building them on first use; None when
    they cannot be had."""
    return _current().lib


def kernel_variant() -> str | None:
    """The name of the variant in use ('avx512-vnni', 'avx2'), or None without kernels."""
    loaded = _current()
    return loaded.variant if loaded.lib is not None else None


def kernel_status() -> str:
    """'available (<variant>)', or why the CPU kernels are not used."""
    loaded = _current()
    return loaded.reason or f"available ({loaded.variant})"


def loaded_variant() -> str | None:
    """The variant the library in use reports it was compiled as (None: no kernels)."""
    lib = load_library()
    return None if lib is None else lib.loom_kernel_variant().decode()


@contextlib.contextmanager
def use_variant(name: str) -> Iterator[None]:
    """Run the kernels of variant `name` inside the block (which must be runnable here).
    Objects that keep the library (a fused decoder) keep the variant they were built with."""
    global _active
    variant_named(name)
    previous = _active
    _active = name
    try:
        if load_library() is None:
            raise RuntimeError(f"CPU kernel variant {name} unavailable: {kernel_status()}")
        yield
    finally:
        _active = previous
