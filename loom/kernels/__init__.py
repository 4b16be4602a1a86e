"""Native CPU kernels (AVX2 C, built at first use) with pure-torch fallbacks elsewhere.

`cpu_kernels_available()` tells whether they can run here; the wrappers in `cpu_ops`
check tensor dtypes, devices and layouts and raise on misuse, so callers decide the
fallback once.
"""

from loom.kernels.build import kernel_status, load_library
from loom.kernels.cpu_ops import (
    GGUF_C_BLOCK_TYPES,
    KV_CACHE_KERNEL_DTYPES,
    argmax_logsumexp,
    cpu_kernels_available,
    dequantize_gguf_blocks,
    linear_f32,
    linear_w8,
    linear_w8a8_reference,
    paged_attention,
    rms_norm,
    rope_neox,
    use_cpu_kernels,
)

# Names the arithmetic of the C kernels (the order of every floating-point operation a
# token's values go through). Bump it whenever a kernel change can change a single bit of
# any result: K/V stored by engines of another arithmetic must never be loaded
# (`KVCacheSpec.arithmetic`).
KERNEL_ARITHMETIC = "loom-cpu-2"

__all__ = [
    "GGUF_C_BLOCK_TYPES",
    "KERNEL_ARITHMETIC",
    "KV_CACHE_KERNEL_DTYPES",
    "argmax_logsumexp",
    "cpu_kernels_available",
    "dequantize_gguf_blocks",
    "kernel_status",
    "linear_f32",
    "linear_w8",
    "linear_w8a8_reference",
    "load_library",
    "paged_attention",
    "rms_norm",
    "rope_neox",
    "use_cpu_kernels",
]
