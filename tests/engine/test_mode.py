"""Execution-mode choice (dtype, quantization, KV dtype) on described hosts, not this one."""

from __future__ import annotations

import pytest

from loom.engine.mode import (
    BF16_MIN_SPEEDUP,
    ExecutionMode,
    HostInfo,
    choose_mode,
    measure_bf16_speedup,
)

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


def test_a_quantized_gguf_runs_w8a8_with_a_float16_kv_cache_on_the_cpu_kernels() -> None:
    assert auto(True, AVX2) == ExecutionMode("float32", "w8a8", "float16")
    # Hosts with native bf16 that measures faster multiply compute-bound calls in bf16.
    for host in (AVX512_BF16, AMX):
        assert auto(True, host) == ExecutionMode("float32", "w8a8", "float16", "bfloat16")


def test_prefill_in_bf16_needs_native_bf16_and_a_measured_speedup() -> None:
    slow = HostInfo("cpu", AVX512_BF16.cpu_flags, cpu_kernels=True, bf16_speedup=1.1)
    assert auto(True, slow).large_batch_dtype is None
    # An AVX2 host never takes bf16, whatever a (noisy) probe said: it is emulated there.
    lucky = HostInfo("cpu", AVX2.cpu_flags, cpu_kernels=True, bf16_speedup=3.0)
    assert auto(True, lucky).large_batch_dtype is None
    # An explicit dtype computes every call in it; "auto" lets prefill take bf16, with int8
    # or exact float weights alike.
    assert choose_mode("bfloat16", "int8", "auto", True, AMX).large_batch_dtype is None
    assert choose_mode("float32", "int8", "auto", True, AMX).large_batch_dtype is None
    assert choose_mode("float32", None, "auto", True, AMX).large_batch_dtype is None
    assert choose_mode("auto", "int8", "auto", True, AMX).large_batch_dtype == "bfloat16"
    assert choose_mode("auto", None, "auto", True, AMX) == ExecutionMode(
        "float32", None, "float32", "bfloat16")


def test_float_checkpoints_keep_their_weights_and_pick_the_measured_faster_dtype() -> None:
    # On the kernels: float32 weights (the fused decode), prefill in bf16 where it is native
    # and measured faster.
    assert auto(False, AVX2) == ExecutionMode("float32", None, "float32")
    assert auto(False, AVX512_BF16) == ExecutionMode("float32", None, "float32", "bfloat16")
    assert auto(False, AMX) == ExecutionMode("float32", None, "float32", "bfloat16")
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
        "bfloat16", "w8a8", "float32")
    assert choose_mode("fp32", None, "fp16", False, AMX) == ExecutionMode(
        "float32", None, "float16")


def test_unknown_quantization_is_named() -> None:
    with pytest.raises(ValueError, match=r"'int4'.*auto"):
        choose_mode("auto", "int4", "auto", True, AVX2)


def test_the_startup_description_names_mode_kv_and_isa() -> None:
    assert auto(True, AVX2).describe(AVX2) == "w8a8, kv float16, cpu avx2"
    assert auto(True, AVX512_BF16).describe(AVX512_BF16) == (
        "w8a8, prefill bfloat16, kv float16, cpu avx512-bf16")
    assert auto(False, AMX).describe(AMX) == "float32, prefill bfloat16, kv float32, cpu amx"
    assert auto(True, CUDA).describe(CUDA) == "bfloat16, kv bfloat16, cuda"
    assert HostInfo("cpu").cpu_isa == "baseline"


def test_the_bf16_probe_returns_a_positive_ratio() -> None:
    assert measure_bf16_speedup(rows=8, features=32, out=16) > 0
