"""The row log-sum-exp (loom.kernels.triton_logsumexp): torch's value to float32 rounding,
each row the same bits whatever rows are beside it. In Triton's interpreter on a CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from loom.kernels.triton_logsumexp import logsumexp_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_matches_torch_and_does_not_depend_on_other_rows():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 10_000, generator=gen) * 4).to(DEVICE)  # chunks of 4096 and a tail
    x[3, :] = float("-inf")  # every token masked
    x[4, 17] = 60.0  # one token dominates
    got = logsumexp_rows(x)
    torch.testing.assert_close(got, x.logsumexp(-1), rtol=1e-6, atol=1e-6)
    assert got[3] == float("-inf")
    for first, last in ((0, 1), (2, 5), (8, 9)):
        assert torch.equal(logsumexp_rows(x[first:last]), got[first:last])
    assert torch.equal(logsumexp_rows(x[:, :5000][1:2]), logsumexp_rows(x[1:2, :5000]))


def test_shapes():
    assert logsumexp_rows(torch.empty(0, 7, device=DEVICE)).shape == (0,)
    with pytest.raises(ValueError, match="rows, columns"):
        logsumexp_rows(torch.zeros(7, device=DEVICE))
