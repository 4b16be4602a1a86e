"""Which part of a checkpoint tensor a rank of a tensor-parallel group holds."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    """Which part of the model a process holds: rank `rank` of `world_size`."""

    rank: int
    world_size: int

    def split(self, total: int) -> tuple[int, int]:
        """[start, stop) of this rank's even share of `total` (a multiple of world_size)."""
        size = total // self.world_size
        return self.rank * size, (self.rank + 1) * size

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """[start, stop) of the KV heads this rank's query heads read."""
        if num_kv_heads >= self.world_size:
            return self.split(num_kv_heads)
        first = self.rank * num_kv_heads // self.world_size
        return first, first + 1

    def padded_vocab(self, vocab_size: int) -> int:
        """The vocabulary rounded up to a multiple of world_size."""
        return -(-vocab_size // self.world_size) * self.world_size


@dataclass(frozen=True)
class ShardRule:
    """The part of a checkpoint tensor a parameter holds: rows or columns [start, stop) of
    `dim` (zero-padded past the tensor's end), or, for a row-parallel bias (`first_rank_only`),
    the whole tensor on rank 0 and zeros elsewhere (the all-reduce adds it once)."""

    dim: int = 0
    start: int = 0
    stop: int = 0
    first_rank_only: bool = False
    rank: int = 0

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of `tensor`."""
        if self.first_rank_only:
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        size = tensor.shape[self.dim]
        part = tensor.narrow(self.dim, min(self.start, size),
                             max(0, min(self.stop, size) - self.start))
        missing = self.stop - self.start - part.shape[self.dim]
        if missing > 0:  # the padding rows of a vocabulary-parallel output projection
            pad = list(part.shape)
            pad[self.dim] = missing
            part = torch.cat([part, part.new_zeros(pad)], dim=self.dim)
        return part
