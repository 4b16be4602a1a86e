"""The attention backend factory: a name (or "auto" and a device) -> a backend instance.

It lives apart from `backend` (the interface) because it imports every implementation,
and every implementation imports the interface: keeping both in one module made a cycle.
"""

from __future__ import annotations

import torch

from loom.attention.backend import AttentionBackend
from loom.attention.cpu_backend import CpuAttentionBackend
from loom.attention.torch_backend import TorchAttentionBackend
from loom.attention.triton_backend import TritonAttentionBackend, triton_available
from loom.kernels import cpu_kernels_available

_BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "cpu": CpuAttentionBackend,
    "triton": TritonAttentionBackend,
}


def get_attention_backend(
    name: str = "auto", device: torch.device | str = "cpu"
) -> AttentionBackend:
    """Return the backend registered under `name`; "auto" picks the best one for `device`.

    "auto" is "cpu" (the C decode kernel) on a CPU where Loom's kernels build, "triton" (paged
    attention kernels) on CUDA where Triton imports, else "torch" (the reference). "triton"
    on a CPU runs only under Triton's interpreter (TRITON_INTERPRET=1): tests use it so.
    """
    if name == "auto":
        kind = torch.device(device).type
        if kind == "cpu":
            name = "cpu" if cpu_kernels_available() else "torch"
        else:
            name = "triton" if kind == "cuda" and triton_available() else "torch"
    if name == "triton" and not triton_available():
        raise ValueError("attention backend 'triton' needs the triton package")
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {['auto', *_BACKENDS]}")
    return _BACKENDS[name]()
