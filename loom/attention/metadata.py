"""Per-step attention metadata: where new K/V go and what each sequence attends to."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch


@dataclass
class AttentionMetadata:
    """Batch layout of one forward pass over a paged KV cache.

    Tokens of all B sequences are packed along one axis of length T:

        tokens:           | seq 0 chunk | seq 1 chunk | ... | seq B-1 chunk |
        query_start_loc:  0             q1            q2    ...             T

    Sequence b computes positions [start_pos[b], seq_lens[b]); its K/V for positions
    [0, seq_lens[b]) live in blocks block_tables[b, :ceil(seq_lens[b] / block_size)].
    Rows of `block_tables` are padded with 0 past a sequence's last block (never read
    unmasked).
    """

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset)
    positions: torch.Tensor  # [T] int64: absolute position of each token
    query_start_loc: torch.Tensor  # [B + 1] int64: cumulative chunk lengths
    seq_lens: torch.Tensor  # [B] int64: context length after this step
    block_tables: torch.Tensor  # [B, max_blocks] int64, zero padded
    block_size: int
    # Host-side copies, so backends can plan without device syncs.
    query_lens_list: list[int]
    seq_lens_list: list[int]
    # Memo for per-step plans that several layers share (e.g. decode gather indices).
    plan_cache: dict[object, object] = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        """Number of sequences (chunks) in the batch."""
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        """Number of packed query tokens."""
        return int(self.slot_mapping.shape[0])

    @property
    def is_pure_decode(self) -> bool:
        """True when every sequence computes exactly one token."""
        return all(q == 1 for q in self.query_lens_list)

    @classmethod
    def build(
        cls,
        start_pos: list[int],
        query_lens: list[int],
        block_ids: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build the metadata for sequences given by start position, chunk length and blocks.

        Plain Python lists, one tensor for all fields at the end: a decode step has a handful
        of numbers, and a long chunk costs one list extend per block it touches.
        """
        seq_lens = [s + q for s, q in zip(start_pos, query_lens, strict=True)]
        positions: list[int] = []
        slots: list[int] = []
        for start, end, blocks in zip(start_pos, seq_lens, block_ids, strict=True):
            positions.extend(range(start, end))
            pos = start
            while pos < end:  # the run of slots inside each block the chunk touches
                block, offset = divmod(pos, block_size)
                run = min(block_size - offset, end - pos)
                first = blocks[block] * block_size + offset
                slots.extend(range(first, first + run))
                pos += run
        max_blocks = max(1, max((len(b) for b in block_ids), default=0))
        starts = list(accumulate(query_lens, initial=0))
        fields = (slots, positions, starts, seq_lens)
        flat = [v for f in fields for v in f]
        for b in block_ids:
            flat.extend(b)
            flat.extend([0] * (max_blocks - len(b)))
        # One host tensor, one copy to the device (a single transfer per step on a GPU), and
        # each field a view of it.
        packed = torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True)
        views = list(packed.split([len(f) for f in fields] + [len(block_ids) * max_blocks]))
        return cls(
            slot_mapping=views[0],
            positions=views[1],
            query_start_loc=views[2],
            seq_lens=views[3],
            block_tables=views[4].view(len(block_ids), max_blocks),
            block_size=block_size,
            query_lens_list=list(query_lens),
            seq_lens_list=seq_lens,
        )
