"""The C form of a mixture-of-experts block (`loom_moe_ffn` in kernels/cpu/moe.c).

`SparseMoE.forward` runs its block through `MoEKernel` on the CPU kernels: routing, the
grouping by expert, every chosen expert's gated MLP and the slot-order sum in one C call
(one OpenMP parallel region), with the linear kinds and the activation of the fused decoder
(`loom.models.fused_decode`), which runs the same block body inside its step. A token's
output is the same bits whatever else is in the call (see cpu/moe.c).

This module imports nothing from `loom.models.moe` (it tells the block by its attributes), so
moe.py may import it at the top.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn

from loom.kernels import cpu_kernels_available, load_library
from loom.models.fused_decode import _MoEDesc, _Unsupported, describe_moe, is_sparse_moe


class MoEKernel:
    """Calls `loom_moe_ffn` on a block's descriptor; keeps every tensor it points into.
    The descriptor holds raw pointers to the block's weights: after they change, build a new
    kernel (`SparseMoE.invalidate_kernel`)."""

    def __init__(self, desc: _MoEDesc, keep: list[Any], hidden: int) -> None:
        self._desc = desc
        self._keep = keep  # the tensors and ctypes arrays the descriptor points into
        self.hidden = hidden
        lib = load_library()
        assert lib is not None
        self._fn = lib.loom_moe_ffn

    @classmethod
    def build(cls, moe: nn.Module) -> tuple[MoEKernel | None, str]:
        """The kernel of a SparseMoE block, or None and the reason its modules must run (no
        CPU kernels, parameters that require gradients, a router not float32, an expert
        layer with no kernel form such as a tensor-parallel projection)."""
        if not cpu_kernels_available():
            return None, "CPU kernels unavailable"
        if not is_sparse_moe(moe):
            return None, f"{type(moe).__name__} is not a mixture-of-experts block"
        if any(p.requires_grad for p in moe.parameters()):
            return None, "parameters require gradients (call requires_grad_(False))"
        keep: list[Any] = []
        try:
            desc = describe_moe(moe, keep)
        except _Unsupported as exc:
            return None, str(exc)
        return cls(desc, keep, moe.hidden_size), "ok"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The block of x [T, H] (float32, CPU) -> a new [T, H] tensor."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or (
                x.shape[1] != self.hidden):
            raise ValueError(f"x must be float32 CPU [T, {self.hidden}], got {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}")
        x = x.contiguous()
        y = torch.empty_like(x)
        if x.shape[0]:
            self._fn(ctypes.addressof(self._desc), x.data_ptr(), x.shape[0], y.data_ptr())
        return y
