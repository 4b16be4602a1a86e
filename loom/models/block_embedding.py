"""An embedding table kept as int8 blocks when that is exact: 4x less memory, same lookups.

GGUF files store the token embedding as Q8_0 (the default model's 262,144 x 640 table): every
block of 32 values is an int8 vector times one float16 scale. Dequantised to float32 it takes
671 MB; kept as blocks, 178 MB. `compact_table` finds the blocks of a float32 table and checks
that expanding them gives back every value bit for bit, so the compact form is used only
where it changes no output. Where the output projection shares the table (tied weights in
float modes) the float table is needed anyway and nothing is compacted.
"""

from __future__ import annotations

import torch
from torch import nn

BLOCK = 32
_CHUNK_ROWS = 8192  # rows checked at a time (bounds the temporaries)


def compact_table(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(values int8 [V, D], scales float16 [V, D / 32]) with values * scales == table exactly
    (in float32, per block of 32), or None when the table is not such a product.

    A block's scale is its largest magnitude / 127 (the value GGUF's Q8_0 quantiser stores,
    so its largest int8 is +-127): exact in float32 when it came from a float16 scale.
    """
    if table.dtype != torch.float32 or table.dim() != 2 or table.shape[1] % BLOCK:
        return None
    rows, dim = table.shape
    values = torch.empty(rows, dim, dtype=torch.int8, device=table.device)
    scales = torch.empty(rows, dim // BLOCK, dtype=torch.float16, device=table.device)
    for start in range(0, rows, _CHUNK_ROWS):
        blocks = table[start : start + _CHUNK_ROWS].reshape(-1, dim // BLOCK, BLOCK)
        scale = blocks.abs().amax(dim=-1) / 127.0
        half = scale.to(torch.float16)
        if not torch.equal(half.float(), scale):
            return None
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
        q = blocks / safe
        ints = q.round()
        if not torch.equal(ints, q) or bool((ints.abs() > 127).any()):
            return None
        q8 = ints.to(torch.int8)
        if not torch.equal(q8.float() * scale.unsqueeze(-1), blocks):
            return None
        values[start : start + _CHUNK_ROWS] = q8.reshape(-1, dim)
        scales[start : start + _CHUNK_ROWS] = half
    return values, scales


class BlockInt8Embedding(nn.Module):
    """`nn.Embedding` over a table stored as int8 blocks with float16 scales (see
    `compact_table`); lookups return `dtype` rows equal to the dense table's."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        if embedding_dim % BLOCK:
            raise ValueError(f"embedding_dim {embedding_dim} is not a multiple of {BLOCK}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.out_dtype = dtype
        self.register_buffer(
            "values", torch.empty(num_embeddings, embedding_dim, dtype=torch.int8))
        self.register_buffer(
            "scales", torch.empty(num_embeddings, embedding_dim // BLOCK, dtype=torch.float16))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> BlockInt8Embedding | None:
        """The compact form of `embedding`, or None where it would not be exact."""
        found = compact_table(embedding.weight.detach())
        if found is None:
            return None
        compact = cls(*embedding.weight.shape, embedding.weight.dtype)
        compact.values, compact.scales = found
        return compact

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the table for `input_ids` [...] -> [..., D]."""
        shape = (*input_ids.shape, self.embedding_dim // BLOCK, BLOCK)
        rows = self.values[input_ids].view(shape).float()
        rows = rows * self.scales[input_ids].float().unsqueeze(-1)
        return rows.view(*input_ids.shape, self.embedding_dim).to(self.out_dtype)
