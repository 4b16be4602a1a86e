"""The structured-output mask kernel: forbidden tokens become -inf, nothing else changes,
the same as the torch path that serves other devices."""

from __future__ import annotations

import pytest
import torch

from loom.kernels.cpu_ops import apply_token_bitmask, cpu_kernels_available


def _expected(logits, rows, bits):
    out = logits.clone()
    vocab = logits.shape[1]
    for i, r in enumerate(rows.tolist()):
        for j in range(vocab):
            if not (int(bits[i, j // 32]) >> (j % 32)) & 1:
                out[r, j] = float("-inf")
    return out


@pytest.mark.skipif(not cpu_kernels_available(), reason="CPU kernels not built")
@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 513])
def test_kernel_masks_exactly_the_cleared_bits(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    words = (vocab + 31) // 32
    bits = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int64)
    bits = bits.to(torch.int32)
    bits[0] = -1  # all allowed
    bits[1, 0] = 0  # a word with nothing allowed
    rows = torch.tensor([4, 0, 2])
    want = _expected(logits, rows, bits)
    got = logits.clone()
    apply_token_bitmask(got, rows, bits)
    assert torch.equal(got, want)


def test_torch_path_equals_the_kernel_path():
    from loom.engine.structured_output import _BIT_TABLE

    gen = torch.Generator().manual_seed(0)
    vocab = 300
    logits = torch.randn(4, vocab, generator=gen)
    bits = torch.randint(-(2**31), 2**31 - 1, (2, 10), generator=gen).to(torch.int32)
    rows = torch.tensor([1, 3])
    allowed = _BIT_TABLE[bits.view(torch.uint8).view(2, -1).long()].view(2, -1)[:, :vocab]
    via_torch = logits.clone()
    via_torch[rows] = via_torch[rows].masked_fill(~allowed, float("-inf"))
    assert torch.equal(via_torch, _expected(logits, rows, bits))
