"""Native CPU kernels (AVX2 C, built at first use) with pure-torch fallbacks elsewhere.

`cpu_kernels_available()` tells whether they can run here; the wrappers in `cpu_ops`
check tensor dtypes, devices and layouts and raise on misuse, so callers decide the
fallback once.
"""

from types import ModuleType

import torch

from loom.kernels.build import kernel_status, load_library
from loom.kernels.cpu_ops import (
    CLAMPED_SWIGLU_CODE,
    GATED_ACTIVATION_CODES,
    GGUF_C_BLOCK_TYPES,
    KV_CACHE_KERNEL_DTYPES,
    MOE_SCORING_CODES,
    W4A8_MAX_SEGMENTS,
    W4A8_TYPES,
    argmax_logsumexp,
    cpu_kernels_available,
    dequantize_gguf_blocks,
    gated_act,
    linear_f32,
    linear_w4a8,
    linear_w8,
    linear_w8a8_reference,
    moe_route,
    paged_attention,
    rms_norm,
    rope_neox,
    use_cpu_kernels,
    w4a8_dequantize,
    w4a8_pack,
    w4a8_packed_shape,
    w4a8_record_k,
    w4a8_rows,
)

# Names the arithmetic of the C kernels (the order of every floating-point operation a
# token's values go through). Bump it whenever a kernel change can change a single bit of
# any result: K/V stored by engines of another arithmetic must never be loaded
# (`KVCacheSpec.arithmetic`).
KERNEL_ARITHMETIC = "loom-cpu-2"
# The same for the CUDA default mode: the batch-invariant Triton matmul and attention
# (loom.kernels.triton_matmul, triton_attention) with the fused elementwise kernels.
CUDA_INVARIANT_ARITHMETIC = "loom-cuda-1"


def elementwise_kernels(x: torch.Tensor, *params: torch.Tensor) -> ModuleType | None:
    """`loom.kernels.triton_elementwise` when an op on `x` (and `params`) should run on its
    Triton kernels (a CUDA tensor, see `use_triton_elementwise`), else None. Imported at the
    first CUDA op: CPU-only installs may lack Triton."""
    if not x.is_cuda:
        return None
    from loom.kernels import triton_elementwise

    return triton_elementwise if triton_elementwise.use_triton_elementwise(x, *params) else None


__all__ = [
    "CLAMPED_SWIGLU_CODE",
    "CUDA_INVARIANT_ARITHMETIC",
    "GATED_ACTIVATION_CODES",
    "GGUF_C_BLOCK_TYPES",
    "KERNEL_ARITHMETIC",
    "KV_CACHE_KERNEL_DTYPES",
    "MOE_SCORING_CODES",
    "W4A8_MAX_SEGMENTS",
    "W4A8_TYPES",
    "argmax_logsumexp",
    "cpu_kernels_available",
    "dequantize_gguf_blocks",
    "elementwise_kernels",
    "gated_act",
    "kernel_status",
    "linear_f32",
    "linear_w4a8",
    "linear_w8",
    "linear_w8a8_reference",
    "load_library",
    "moe_route",
    "paged_attention",
    "rms_norm",
    "rope_neox",
    "use_cpu_kernels",
    "w4a8_dequantize",
    "w4a8_pack",
    "w4a8_packed_shape",
    "w4a8_record_k",
    "w4a8_rows",
]
