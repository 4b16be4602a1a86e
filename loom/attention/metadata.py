"""Per-step attention metadata: where new K/V go and what each sequence attends to."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    def start_pos_list(self) -> list[int]:
        """Position of each sequence's first query token."""
        return [s - q for s, q in zip(self.seq_lens_list, self.query_lens_list, strict=True)]

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
        """Build the metadata for sequences given by start position, chunk length and blocks."""
        num_seqs = len(query_lens)
        seq_lens = [s + q for s, q in zip(start_pos, query_lens, strict=True)]
        max_blocks = max((len(b) for b in block_ids), default=0)
        table = torch.zeros((num_seqs, max(max_blocks, 1)), dtype=torch.int64)
        for i, blocks in enumerate(block_ids):
            if blocks:
                table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        qsl = torch.zeros(num_seqs + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=qsl[1:])
        num_tokens = int(qsl[-1])
        # seq_idx[t] = sequence of packed token t; positions follow from the chunk offsets.
        seq_idx = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
        starts = torch.tensor(start_pos, dtype=torch.int64)
        positions = torch.arange(num_tokens) - qsl[:-1][seq_idx] + starts[seq_idx]
        slots = table[seq_idx, positions // block_size] * block_size + positions % block_size
        return cls(
            slot_mapping=slots.to(device),
            positions=positions.to(device),
            query_start_loc=qsl.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(device),
            block_tables=table.to(device),
            block_size=block_size,
            query_lens_list=list(query_lens),
            seq_lens_list=seq_lens,
        )
