"""A batch-invariant matmul in Triton: the linear layers of the CUDA default mode.

cuBLAS picks its GEMM algorithm (tile shape, split-K) from the call's shape, so the same
row of activations times the same weight can round differently at 1 row than at 64: a
token's logits would depend on what else is batched with it. This kernel fixes the
arithmetic of an output element whatever the number of rows:

    y[m, n] = sum over k-tiles t = 0, 1, ... of dot(x[m, t*BK:(t+1)*BK], w[n, t*BK:(t+1)*BK])

accumulated in float32 in that order (no split-K), each tile's dot on the tensor cores with
one tile shape (`_BLOCK_M` x `block_n_for(N)` x `_BLOCK_K`, the same warps and stages).
Nothing in the launch depends on M except the number of row tiles: a row's values do not
depend on which tile it lands in or on the rows beside it (masked rows load zeros and are
not stored). The tile's column width may depend on the weight (N), never on the batch.
(Measured on an H200 at Gemma 3 270M's shapes: the bits do not even change with the tile's
rows, columns or warps, and equal cuBLAS's there; only the K order is the arithmetic. The
launch still keeps everything but the grid fixed, so the guarantee does not rest on that.)

Triton's interpreter runs it on a CPU (tests); there `input_precision="ieee"` keeps float32
inputs exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows and reduction depth of every tile (wgmma's 64 rows on Hopper).
_BLOCK_M = 64
_BLOCK_K = 64
# Output columns a launch should cover with at least this many programs when small weights
# are read by few rows (decode): narrow tiles for narrow outputs.
_MIN_PROGRAMS = 64


def block_n_for(n: int) -> int:
    """Output columns per tile for a weight of `n` rows: a function of the weight alone."""
    for width in (128, 64, 32):
        if triton.cdiv(n, width) >= _MIN_PROGRAMS:
            return width
    return 16


# M changes every step: it is neither specialised (== 1, divisible by 16) nor part of the
# compiled variant, so a decode step and a prefill chunk run the same machine code.
@triton.jit(do_not_specialize=["M"])
def _matmul(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols[None, :] * stride_wn + (k0 + ks)[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias) in x's dtype, each row computed by the same
    operations whatever the number of rows (see the module docstring)."""
    if x.dtype != weight.dtype:
        raise TypeError(f"invariant_linear: x is {x.dtype} but the weight is {weight.dtype}")
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = rows.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        block_n = block_n_for(n)
        grid = (triton.cdiv(m, _BLOCK_M), triton.cdiv(n, block_n))
        _matmul[grid](
            rows, weight, y if bias is None else bias, y, m, n, k,
            rows.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=_BLOCK_K,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=4, num_stages=4,
        )
    return y.view(*x.shape[:-1], n)
