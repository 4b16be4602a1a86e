"""The attention backend interface (the factory that picks one lives in `selector`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from loom.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionSpec:
    """Static per-layer attention parameters."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # key visible iff key_pos > query_pos - window
    logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    # Attention sinks (gpt-oss): None, or [num_heads], one learned logit per query head that
    # joins every row's softmax (its max and its sum) with no value row, so a row's weights
    # sum to less than one. Not multiplied by `scale`. The layer's parameter itself, bound
    # at run time (`PagedAttention`): not part of the spec's equality.
    sinks: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of {self.num_kv_heads}")
        if self.sinks is not None and tuple(self.sinks.shape) != (self.num_heads,):
            raise ValueError(f"sinks {tuple(self.sinks.shape)} must be one logit per head"
                             f" ({self.num_heads},)")


class AttentionBackend(ABC):
    """Writes new K/V into a paged cache and attends over each sequence's context."""

    name: str = "abstract"
    # Whether small CPU steps may skip this backend for the fused decoder (loom.models.
    # fused_decode), which writes K/V and attends with Loom's C kernel: the same results as
    # the CPU and torch backends. A backend whose own kernels must run says False.
    fused_cpu_decode: bool = True

    def reads_only_written_slots(self, dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> bool:
        """Whether every read of the cache in this configuration stays inside the slots the
        step's sequences have written. Then the pool need not be zeroed: it is left
        unwritten (the OS maps pages as the K/V first touches them, so an unused pool costs
        neither start-up time nor resident memory). Backends that gather whole blocks and
        mask the rest read unwritten slots, which must hold finite values (zeros)."""
        return False

    @abstractmethod
    def forward(
        self,
        spec: AttentionSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Attend: q [T, H, D], k/v [T, Hkv, D] -> output [T, H * D] (stores k/v first)."""


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    zeroed: bool = True,
) -> list[torch.Tensor]:
    """Allocate one [2, num_blocks, block_size, num_kv_heads, head_dim] cache per layer, zeroed
    unless `zeroed=False` (for a backend that `reads_only_written_slots`)."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    make = torch.zeros if zeroed else torch.empty
    return [make(shape, dtype=dtype, device=device) for _ in range(num_layers)]
