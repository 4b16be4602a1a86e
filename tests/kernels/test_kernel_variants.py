"""CPU kernel variants: chosen by the host's CPU features, named by kernel_status(), each one
built from the same source with its own flags."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from loom.kernels import build
from loom.kernels.build import VARIANTS, runnable_variants, use_variant, variant_named

AVX2_HOST = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
AVX512_HOST = AVX2_HOST | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                           "avx512_bf16"}


def test_the_widest_variant_the_cpu_runs_comes_first() -> None:
    assert runnable_variants(AVX512_HOST) == ["avx512-vnni", "avx2"]
    assert runnable_variants(AVX512_HOST | {"avx_vnni"}) == ["avx512-vnni", "avx2-vnni", "avx2"]
    assert runnable_variants(AVX2_HOST | {"avx_vnni"}) == ["avx2-vnni", "avx2"]
    assert runnable_variants(AVX2_HOST) == ["avx2"]
    assert runnable_variants(AVX512_HOST - {"avx512_vnni"}) == ["avx2"]
    assert runnable_variants(frozenset({"sse4_2", "avx"})) == []
    with pytest.raises(ValueError, match="unknown CPU kernel variant 'sse9'"):
        variant_named("sse9")


def _status_in_subprocess(**env: str) -> str:
    code = "from loom.kernels import kernel_status\nprint(kernel_status())\n"
    inherited = {k: v for k, v in os.environ.items() if k != build.VARIANT_ENV}
    return subprocess.run(
        [sys.executable, "-c", code], env={**inherited, **env}, capture_output=True,
        text=True, check=True,
    ).stdout.strip()


@pytest.mark.skipif(not runnable_variants(), reason="this CPU runs no kernel variant")
def test_status_names_the_variant_and_the_environment_can_pick_one() -> None:
    env = {k: v for k, v in os.environ.items() if k != build.VARIANT_ENV}
    widest = runnable_variants()[0]
    assert _status_in_subprocess(**env) == f"available ({widest})"
    assert _status_in_subprocess(LOOM_CPU_KERNEL_VARIANT="avx2") == "available (avx2)"
    unknown = _status_in_subprocess(LOOM_CPU_KERNEL_VARIANT="sse9")
    assert unknown.startswith("LOOM_CPU_KERNEL_VARIANT=sse9 names no variant")
    for name in {v.name for v in VARIANTS} - set(runnable_variants()):
        assert "needs CPU features this host lacks" in _status_in_subprocess(
            LOOM_CPU_KERNEL_VARIANT=name
        )
        with pytest.raises(RuntimeError, match=f"variant {name} unavailable"), use_variant(name):
            pass


@pytest.mark.parametrize("variant", [v.name for v in VARIANTS])
def test_every_variant_compiles_here_with_its_own_instructions(variant: str) -> None:
    """Each variant builds on this machine even where it cannot run (a host without AVX-512
    still proves the AVX-512 source compiles); the VNNI ones multiply int8 with vpdpbusd."""
    compiler = build._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    library = build._build(compiler, variant_named(variant))
    assert library.exists() and variant in library.name
    objdump = shutil.which("objdump")
    if objdump is None:
        return
    listing = subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
        check=True,
    ).stdout
    vnni = variant in ("avx512-vnni", "avx2-vnni")
    assert ("vpdpbusd" in listing) == vnni
    assert "zmm" not in listing  # 256-bit vectors only (no 512-bit clock penalty)
    assert ("vpmaddubsw" in listing) == (not vnni)


@pytest.mark.skipif("avx2" not in runnable_variants(), reason="this CPU cannot run AVX2")
def test_a_variant_that_fails_to_build_falls_back_to_the_next(monkeypatch) -> None:
    """A compiler without AVX-512 support must not leave an AVX-512 host without kernels."""
    real_build = build._build

    def failing_wide_build(compiler, variant):
        if variant.name == "avx512-vnni":
            raise RuntimeError("cc: error: unrecognized command-line option '-mavx512vnni'")
        return real_build(compiler, variant)

    monkeypatch.delenv(build.VARIANT_ENV, raising=False)
    monkeypatch.setattr(build, "runnable_variants", lambda flags=None: ["avx512-vnni", "avx2"])
    monkeypatch.setattr(build, "_build", failing_wide_build)
    loaded = build._try_load(None)
    assert loaded.lib is not None and loaded.variant == "avx2"

    def failing_build(compiler, variant):
        raise RuntimeError(f"no {variant.name}")

    monkeypatch.setattr(build, "_build", failing_build)
    failed = build._try_load(None)
    assert failed.lib is None
    assert failed.reason == ("avx512-vnni: build or load failed: no avx512-vnni; "
                             "avx2: build or load failed: no avx2")
