"""Embedding tables kept as int8 blocks only where that is exact."""

from __future__ import annotations

import torch

from loom.models.block_embedding import BlockInt8Embedding, compact_table


def _q8_0_table(rows: int, dim: int, seed: int = 0) -> torch.Tensor:
    """A float32 table as GGUF's Q8_0 dequantises: int8 (largest +-127) x float16 scale."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, dim // 32, 32), generator=g, dtype=torch.int64)
    q[..., 0] = 127 * torch.where(torch.rand(rows, dim // 32, generator=g) < 0.5, -1, 1)
    scale = (torch.rand(rows, dim // 32, generator=g) * 0.01).half().float()
    scale[0, 0] = 0.0  # an all-zero block
    q[0, 0] = 0
    return (q.float() * scale.unsqueeze(-1)).reshape(rows, dim)


def test_a_q8_0_table_is_kept_as_blocks_with_identical_lookups() -> None:
    table = _q8_0_table(300, 96)
    dense = torch.nn.Embedding.from_pretrained(table)
    compact = BlockInt8Embedding.from_embedding(dense)
    assert compact is not None
    assert compact.values.dtype == torch.int8 and compact.scales.dtype == torch.float16
    ids = torch.tensor([[0, 5, 299], [17, 17, 1]])
    assert torch.equal(compact(ids), dense(ids))
    assert torch.equal(compact(torch.arange(300)), table)


def test_tables_that_are_not_exact_products_stay_dense() -> None:
    assert compact_table(torch.randn(64, 64)) is None  # plain floats
    table = _q8_0_table(64, 64)
    table[10, 3] = table[10, 3] * (1 + 2**-20)  # one value off its block's grid
    assert compact_table(table) is None
    assert compact_table(_q8_0_table(8, 64).bfloat16()) is None  # not float32
    assert compact_table(torch.zeros(8, 48)) is None  # rows not whole blocks
