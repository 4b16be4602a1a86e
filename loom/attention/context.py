"""The forward context: per-step attention state that layers read, set only by the runner."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loom.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from loom.attention.backend import AttentionBackend


@dataclass(frozen=True)
class ForwardContext:
    """What attention layers need during one forward pass."""

    metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]  # per layer: [2, num_blocks, block_size, kv_heads, head_dim]
    backend: AttentionBackend


# Invariant: holds a value only inside a `forward_context(...)` block.
_CURRENT: ContextVar[ForwardContext | None] = ContextVar("loom_forward_context", default=None)


@contextmanager
def forward_context(
    metadata: AttentionMetadata,
    kv_caches: list[torch.Tensor],
    backend: AttentionBackend,
) -> Iterator[ForwardContext]:
    """Make the metadata and KV caches visible to attention layers for the block's duration."""
    ctx = ForwardContext(metadata=metadata, kv_caches=kv_caches, backend=backend)
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def get_forward_context() -> ForwardContext:
    """Return the active forward context; raise if a model runs outside the runner."""
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError("attention called outside forward_context(); run models via the runner")
    return ctx
