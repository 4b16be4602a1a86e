"""The attention module models use: it reads the step's metadata from the forward context."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from loom.attention.backend import AttentionSpec
from loom.attention.context import get_forward_context


class PagedAttention(nn.Module):
    """Stores K/V of new tokens in this layer's cache and attends over the context."""

    def __init__(self, layer_idx: int, spec: AttentionSpec) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.spec = spec
        # `spec` (fixed once built) with the layer's sinks bound, made again whenever another
        # sinks tensor arrives (the parameter is replaced when its weight loads).
        self._bound: AttentionSpec | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]; `sinks` [H]: the layer's attention sinks
        (see `AttentionSpec.sinks`)."""
        ctx = get_forward_context()
        s = self.spec if sinks is None else self._with_sinks(sinks)
        return ctx.backend.forward(
            s,
            q.view(-1, s.num_heads, s.head_dim),
            k.view(-1, s.num_kv_heads, s.head_dim),
            v.view(-1, s.num_kv_heads, s.head_dim),
            ctx.kv_caches[self.layer_idx],
            ctx.metadata,
        )

    def _with_sinks(self, sinks: torch.Tensor) -> AttentionSpec:
        bound = self._bound
        if bound is None or bound.sinks is not sinks:
            bound = self._bound = dataclasses.replace(self.spec, sinks=sinks)
        return bound
