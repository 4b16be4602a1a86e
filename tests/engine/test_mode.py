"""Execution-mode choice (dtype, quantization, KV dtype) on described hosts, not this one."""

from __future__ import annotations

import argparse

import pytest
from engine.helpers import make_engine

from loom.engine.mode import (
    BF16_MIN_SPEEDUP,
    ExecutionMode,
    HostInfo,
    choose_mode,
    measure_bf16_speedup,
)
from loom.errors import InvalidRequestError
from loom.server.cli import add_engine_args, engine_args_from

AVX2 = HostInfo("cpu", frozenset({"avx2", "fma"}), cpu_kernels=True, bf16_speedup=0.15)
AVX512_BF16 = HostInfo("cpu", frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}),
                       cpu_kernels=True, bf16_speedup=2.1)
AMX = HostInfo("cpu", frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8"}),
               cpu_kernels=True, bf16_speedup=3.0)
NO_KERNELS = HostInfo("cpu", frozenset(), cpu_kernels=False, bf16_speedup=0.2)
CUDA = HostInfo("cuda", frozenset({"avx2"}), cuda_bf16=True)
OLD_CUDA = HostInfo("cuda", frozenset({"avx2"}), cuda_bf16=False)


def auto(quantized: bool, host: HostInfo) -> ExecutionMode:
    return choose_mode("auto", "auto", "auto", quantized, host)


def test_a_quantized_gguf_runs_w4a8_with_a_float16_kv_cache_on_the_cpu_kernels() -> None:
    # Every host, native bf16 or not, computes prefill with the same arithmetic as decode.
    for host in (AVX2, AVX512_BF16, AMX):
        assert auto(True, host) == ExecutionMode("float32", "w4a8", "float16")


def test_auto_never_picks_a_bf16_prefill() -> None:
    """Bit-identical logits across batching and chunking need one arithmetic for every call,
    so bf16 prefill is only ever an explicit choice, however fast bf16 measures."""
    fast = HostInfo("cpu", AMX.cpu_flags, cpu_kernels=True, bf16_speedup=100.0)
    for host in (AVX2, AVX512_BF16, AMX, fast, NO_KERNELS, CUDA):
        for quantization in ("auto", "int8", "w8a8", None):
            for quantized in (True, False):
                mode = choose_mode("auto", quantization, "auto", quantized, host)
                assert mode.large_batch_dtype is None
                assert choose_mode("auto", quantization, "auto", quantized, host,
                                   prefill_dtype="auto") == mode


@pytest.mark.parametrize("name", ["bfloat16", "bf16"])
def test_an_explicit_bf16_prefill_multiplies_compute_bound_calls_in_bf16(name) -> None:
    # On float32 activations on a CPU, with int8 or float weights, on any ISA (on AVX2 it is
    # emulated: slow, but what was asked for). "auto" then takes w8a8, whose int8 weights
    # multiply in bf16 (w4a8 computes every call from the file's blocks).
    assert choose_mode("auto", "auto", "auto", True, AMX, prefill_dtype=name) == ExecutionMode(
        "float32", "w8a8", "float16", "bfloat16")
    with pytest.raises(ValueError, match="'w4a8' computes every call from the file's blocks"):
        choose_mode("auto", "w4a8", "auto", True, AMX, prefill_dtype=name)
    assert choose_mode("auto", "int8", "auto", True, AMX, prefill_dtype=name) == ExecutionMode(
        "float32", "int8", "float32", "bfloat16")
    assert choose_mode("float32", None, "auto", False, AVX2, prefill_dtype=name) == (
        ExecutionMode("float32", None, "float32", "bfloat16"))
    assert choose_mode("auto", None, "auto", False, NO_KERNELS, prefill_dtype=name) == (
        ExecutionMode("float32", None, "float32", "bfloat16"))


def test_a_float32_or_model_dtype_prefill_is_the_same_arithmetic_as_decode() -> None:
    for name in ("float32", "fp32"):
        assert choose_mode("auto", "auto", "auto", True, AMX, prefill_dtype=name) == (
            auto(True, AMX))
    # A bfloat16 model already computes every call in bf16.
    assert choose_mode("bfloat16", None, "auto", False, AMX, prefill_dtype="bf16") == (
        ExecutionMode("bfloat16", None, "bfloat16"))
    assert choose_mode("auto", None, "auto", False, CUDA, prefill_dtype="bfloat16") == (
        ExecutionMode("bfloat16", None, "bfloat16"))
    assert choose_mode("auto", None, "auto", False, CUDA, prefill_dtype="float32") == (
        ExecutionMode("bfloat16", None, "bfloat16"))


def test_a_bf16_prefill_the_mode_cannot_use_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"prefill_dtype 'bfloat16' needs float32 .* cuda"):
        choose_mode("auto", None, "auto", False, OLD_CUDA, prefill_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"needs float32 activations on a CPU.*float16 on cpu"):
        choose_mode("float16", None, "auto", False, AMX, prefill_dtype="bf16")
    with pytest.raises(ValueError, match=r"unsupported prefill_dtype 'float16'"):
        choose_mode("auto", "auto", "auto", True, AMX, prefill_dtype="float16")
    with pytest.raises(ValueError, match=r"unsupported prefill_dtype 'int4'"):
        choose_mode("auto", "auto", "auto", True, AMX, prefill_dtype="int4")


def test_float_checkpoints_keep_their_weights_and_pick_the_measured_faster_dtype() -> None:
    # On the kernels: float32 weights (the fused decode), on every host.
    for host in (AVX2, AVX512_BF16, AMX):
        assert auto(False, host) == ExecutionMode("float32", None, "float32")
    # Without the kernels the whole model takes the measured faster dtype.
    no_kernels_amx = HostInfo("cpu", AMX.cpu_flags, cpu_kernels=False, bf16_speedup=3.0)
    assert auto(False, no_kernels_amx) == ExecutionMode("bfloat16", None, "bfloat16")


def test_bf16_flags_alone_do_not_pick_bf16_when_it_measured_slower() -> None:
    for kernels in (True, False):
        slow = HostInfo("cpu", AVX512_BF16.cpu_flags, cpu_kernels=kernels,
                        bf16_speedup=BF16_MIN_SPEEDUP - 0.01)
        assert auto(False, slow) == ExecutionMode("float32", None, "float32")


def test_without_the_cpu_kernels_quantized_weights_run_dequantised() -> None:
    assert auto(True, NO_KERNELS) == ExecutionMode("float32", None, "float32")


def test_cuda_runs_float_weights_in_bf16_or_fp16() -> None:
    assert auto(True, CUDA) == ExecutionMode("bfloat16", None, "bfloat16")
    assert auto(True, OLD_CUDA) == ExecutionMode("float16", None, "float16")


@pytest.mark.parametrize("none", [None, "none"])
def test_quantization_none_is_exact_float_everywhere(none) -> None:
    assert choose_mode("auto", none, "auto", True, AVX2) == ExecutionMode(
        "float32", None, "float32")
    assert choose_mode("float32", none, "auto", True, AMX).quantization is None


def test_explicit_choices_are_kept() -> None:
    # An explicit w8a8 keeps the model-dtype KV cache (the "w8a8" benchmark mode) ...
    assert choose_mode("auto", "w8a8", "auto", False, AVX2) == ExecutionMode(
        "float32", "w8a8", "float32")
    # ... and explicit dtypes win over the host's preference.
    assert choose_mode("bfloat16", "auto", "float32", True, AVX2) == ExecutionMode(
        "bfloat16", "w4a8", "float32")
    assert choose_mode("fp32", None, "fp16", False, AMX) == ExecutionMode(
        "float32", None, "float16")


def test_w4a8_runs_only_on_the_cpu_kernels_and_w8a8_stays_a_choice() -> None:
    for host in (AVX2, AVX512_BF16, AMX):
        assert choose_mode("auto", "w4a8", "float16", True, host) == ExecutionMode(
            "float32", "w4a8", "float16")
        assert choose_mode("auto", "w8a8", "float16", True, host) == ExecutionMode(
            "float32", "w8a8", "float16")
    for host in (NO_KERNELS, CUDA):
        with pytest.raises(ValueError, match="'w4a8' runs on Loom's CPU kernels"):
            choose_mode("auto", "w4a8", "auto", True, host)


def test_unknown_quantization_is_named() -> None:
    with pytest.raises(ValueError, match=r"'int4'.*auto"):
        choose_mode("auto", "int4", "auto", True, AVX2)


def test_the_startup_description_names_mode_kv_and_isa() -> None:
    assert auto(True, AVX2).describe(AVX2) == "w4a8, kv float16, cpu avx2"
    assert auto(True, AVX512_BF16).describe(AVX512_BF16) == "w4a8, kv float16, cpu avx512-bf16"
    assert choose_mode("auto", "auto", "auto", True, AVX512_BF16, prefill_dtype="bf16").describe(
        AVX512_BF16) == "w8a8, prefill bfloat16, kv float16, cpu avx512-bf16"
    assert auto(False, AMX).describe(AMX) == "float32, kv float32, cpu amx"
    assert auto(True, CUDA).describe(CUDA) == "bfloat16, kv bfloat16, cuda"
    assert HostInfo("cpu").cpu_isa == "baseline"


def test_the_bf16_probe_returns_a_positive_ratio() -> None:
    assert measure_bf16_speedup(rows=8, features=32, out=16) > 0


def test_loom_serve_has_a_prefill_dtype_flag() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args([])).prefill_dtype == "auto"
    args = engine_args_from(parser.parse_args(["--prefill-dtype", "bfloat16"]))
    assert args.prefill_dtype == "bfloat16"


def test_an_engine_takes_prefill_dtype_and_rejects_what_its_mode_cannot_use(tiny_models) -> None:
    folder = tiny_models["llama"][0]
    engine = make_engine(folder, prefill_dtype="bf16")
    assert engine.config.mode_summary.startswith("float32, prefill bfloat16, kv float32, cpu")
    with pytest.raises(InvalidRequestError, match="unsupported prefill_dtype 'int4'"):
        make_engine(folder, prefill_dtype="int4")
    with pytest.raises(InvalidRequestError, match="unsupported prefill_dtype 'float16'"):
        make_engine(folder, prefill_dtype="float16")
    with pytest.raises(InvalidRequestError, match="needs float32 activations on a CPU"):
        make_engine(folder, dtype="float16", prefill_dtype="bfloat16")
