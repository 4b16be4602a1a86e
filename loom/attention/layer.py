"""The attention module models use: it reads the step's metadata from the forward context."""

from __future__ import annotations

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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]."""
        ctx = get_forward_context()
        s = self.spec
        return ctx.backend.forward(
            s,
            q.view(-1, s.num_heads, s.head_dim),
            k.view(-1, s.num_kv_heads, s.head_dim),
            v.view(-1, s.num_kv_heads, s.head_dim),
            ctx.kv_caches[self.layer_idx],
            ctx.metadata,
        )
