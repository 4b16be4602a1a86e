"""Compile `cpu_kernels.c` once per machine with the system C compiler and load it.

The shared library is cached under `loom_cache_dir("kernels")`, keyed by a hash of the
source, the flags and the compiler, and written atomically so concurrent processes never
load a half-written file. Anything that goes wrong (no compiler, no AVX2/FMA, a failed
build, `LOOM_CPU_KERNELS=0`) leaves the kernels unavailable and Loom on its pure-torch
paths; the reason is kept for `kernel_status()`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from loom.cache_dir import loom_cache_dir

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# -mf16c: float16 KV caches (every AVX2 CPU has F16C). -ffp-contract=off: every fused
# multiply-add is an explicit intrinsic, so results do not depend on how the compiler
# contracts the scalar code (batch invariance relies on it).
FLAGS = (
    "-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
    "-fvisibility=hidden",
)

_i64, _f32 = ctypes.c_int64, ctypes.c_float
_ptr = ctypes.c_void_p
# Argument types of every exported function (see cpu_kernels.c for the meaning).
SIGNATURES: dict[str, list[type]] = {
    "loom_linear_w8": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr],
    "loom_linear_w8a8": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr],
    "loom_linear_w8a8_quad": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr],
    "loom_linear_f32": [_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr],
    "loom_paged_attention": [
        _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
        _f32, _f32, _ptr, _i64, _ptr, _i64,
    ],
    "loom_rms_norm": [_ptr, _i64, _i64, _ptr, _f32, _f32, _ptr, _ptr],
    "loom_rope_neox": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr],
    "loom_attention_scratch_floats": [_i64, _i64, _i64, _i64],
    "loom_argmax_logsumexp": [_ptr, _i64, _i64, _ptr, _ptr],
}
# Functions that return a value (the others return void).
RESTYPES: dict[str, type] = {"loom_attention_scratch_floats": _i64}

@dataclass
class _Loaded:
    """The outcome of the one build-and-load attempt per process."""

    lib: ctypes.CDLL | None
    reason: str | None  # why `lib` is None


_loaded: _Loaded | None = None

def _cpu_supported() -> str | None:
    """None when this CPU runs the kernels, else why not."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"CPU capability {capability!r} lacks AVX2"
    return None


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _build(compiler: str) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode()
    ).hexdigest()[:16]
    target = loom_cache_dir("kernels") / f"loom_cpu_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"],
            capture_output=True, text=True, check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _try_load() -> _Loaded:
    if os.environ.get("LOOM_CPU_KERNELS", "1") == "0":
        return _Loaded(None, "disabled by LOOM_CPU_KERNELS=0")
    unsupported = _cpu_supported()
    if unsupported is not None:
        return _Loaded(None, unsupported)
    compiler = _compiler()
    if compiler is None:
        return _Loaded(None, "no C compiler (cc, gcc or clang) on PATH")
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
        for name, argtypes in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = RESTYPES.get(name)
    except (OSError, RuntimeError, AttributeError) as exc:
        return _Loaded(None, f"build or load failed: {exc}")
    return _Loaded(lib, None)


def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first use; None when they cannot be had."""
    global _loaded
    if _loaded is None:
        _loaded = _try_load()
    return _loaded.lib


def kernel_status() -> str:
    """'available', or why the CPU kernels are not used."""
    load_library()
    assert _loaded is not None
    return _loaded.reason or "available"
