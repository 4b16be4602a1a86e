"""log-sum-exp of each row in Triton: the normaliser of a logprob on CUDA.

torch's reduction kernels size their split of a row by the whole tensor (a lone row is
summed by many blocks, one row of 64 by fewer), so `logits.logsumexp(-1)` of the same row
rounds differently at 1 row than at 64 (measured on an H200: one unit in the last place):
a sampled token's logprob would depend on the batch. Here one program reads one row, in
chunks of `_BLOCK` columns in order: the max, then the sum of exp(x - max), each chunk's
sum a fixed tree of `_BLOCK` lanes added to the running total, so a row's value depends on
the row alone. Triton's interpreter runs it on a CPU (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns per chunk; fixed: it shapes the summation tree.
_BLOCK = 4096


@triton.jit
def _logsumexp_rows(x_ptr, out_ptr, cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride
    offs = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, cols, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < cols, other=float("-inf"))
        top = tl.maximum(top, x.to(tl.float32))
    peak = tl.max(top, 0)
    # A row of -inf (every token masked) keeps -inf; shift by 0 so exp gives 0, not nan.
    shift = tl.where(peak == float("-inf"), 0.0, peak)
    total = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    for start in range(0, cols, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < cols, other=float("-inf"))
        total += tl.sum(tl.exp(x.to(tl.float32) - shift), 0)
    tl.store(out_ptr + row, shift + tl.log(total))


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(x), -1)) of each row of a 2-D float tensor, in float32, each row by the
    same operations whatever the other rows (see the module docstring)."""
    if x.dim() != 2:
        raise ValueError(f"logsumexp_rows takes [rows, columns], got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _logsumexp_rows[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=_BLOCK,
                                       num_warps=8, enable_fp_fusion=False)
    return out
