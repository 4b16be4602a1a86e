"""Which part of a checkpoint tensor a rank of a tensor-parallel group holds."""

from __future__ import annotations

from collections.abc import Callable
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
    the whole tensor on rank 0 and zeros elsewhere (the all-reduce adds it once).

    Loaders read only `span(size)` of `dim` where their format allows (`pad` then completes
    the part) and otherwise cut a whole tensor with `apply`."""

    dim: int = 0
    start: int = 0
    stop: int = 0
    first_rank_only: bool = False
    rank: int = 0

    def span(self, size: int) -> tuple[int, int]:
        """The [start, stop) of `dim` to read from a tensor `size` long there."""
        start = min(self.start, size)
        return start, max(start, min(self.stop, size))

    def pad(self, part: torch.Tensor) -> torch.Tensor:
        """`part` (the `span` read) with zeros past the tensor's end: the padding rows of a
        vocabulary-parallel output projection."""
        missing = self.stop - self.start - part.shape[self.dim]
        if missing <= 0:
            return part
        shape = list(part.shape)
        shape[self.dim] = missing
        return torch.cat([part, part.new_zeros(shape)], dim=self.dim)

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole `tensor`."""
        if self.first_rank_only:
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        start, stop = self.span(tensor.shape[self.dim])
        return self.pad(tensor.narrow(self.dim, start, stop - start))


# Which part of the checkpoint tensor of a given (HF) name to read; None: all of it.
WeightSelector = Callable[[str], "ShardRule | None"]
