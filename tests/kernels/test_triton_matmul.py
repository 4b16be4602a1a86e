"""The batch-invariant matmul (loom.kernels.triton_matmul): equal to torch's linear to
float32 rounding, and each row the same bits whatever rows are beside it. In Triton's
interpreter on a CPU (tests/conftest.py), compiled on a GPU where there is one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from loom.kernels.triton_matmul import block_n_for, invariant_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch_linear(dtype, bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 96, generator=gen).to(DEVICE, dtype)  # K not a multiple of 64
    w = torch.randn(80, 96, generator=gen).to(DEVICE, dtype)
    b = torch.randn(80, generator=gen).to(DEVICE, dtype) if bias else None
    got = invariant_linear(x, w, b)
    assert got.shape == (3, 5, 80) and got.dtype == dtype
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_does_not_depend_on_the_rows_beside_it(dtype):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(70, 130, generator=gen).to(DEVICE, dtype)
    rows = torch.randn(150, 130, generator=gen).to(DEVICE, dtype)
    picked = (0, 63, 64, 149)  # tile edges: a row's place in its tile must not matter
    alone = {i: invariant_linear(rows[i:i + 1], w)[0] for i in picked}
    for first, last in ((0, 1), (0, 65), (0, 150), (63, 150)):  # batches rows[first:last]
        got = invariant_linear(rows[first:last], w)
        for i in picked:
            if first <= i < last:
                assert torch.equal(got[i - first], alone[i]), (first, last, i)


def test_edges():
    w = torch.randn(16, 8).to(DEVICE)
    assert invariant_linear(torch.empty(0, 8, device=DEVICE), w).shape == (0, 16)
    strided = torch.randn(4, 16, device=DEVICE)[:, ::2]  # rows with a stride of 2
    torch.testing.assert_close(invariant_linear(strided, w), strided @ w.T, rtol=1e-4,
                               atol=1e-4)
    with pytest.raises(TypeError, match="bfloat16"):
        invariant_linear(torch.randn(2, 8, device=DEVICE), w.to(torch.bfloat16))
    # The tile width depends on the weight alone: wide outputs get wide tiles.
    assert block_n_for(262_144) == 128 and block_n_for(4096) == 64 and block_n_for(2048) == 32
    assert block_n_for(640) == 16
