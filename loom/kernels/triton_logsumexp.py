"""log-sum-exp of each row in Triton: the normaliser of a logprob on CUDA.

torch's reduction kernels size their split of a row by the whole tensor (a lone row is
summed by many blocks, one row of 64 by fewer), so `logits.logsumexp(-1)` of the same row
rounds differently at 1 row than at 64 (measured on an H200: one unit in the last place):
a sampled token's logprob would depend on the batch. Here the split is fixed by the
columns alone:

    chunk c = columns [c * _CHUNK, (c + 1) * _CHUNK)        (one program per row and chunk)
    m_c = max over the chunk,  s_c = sum of exp(x - m_c)    (a fixed tree of _CHUNK lanes)
    lse = M + log(sum over c of s_c * exp(m_c - M)),  M = max of m_c
                                                     (one program per row, a fixed tree of
                                                      the row's chunk count, a power of two)

so a row's value depends on the row alone, and a lone row is still read by many programs
(a 262,144-token vocabulary: 64). Triton's interpreter runs it on a CPU (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns per chunk; fixed: it shapes the summation trees.
_CHUNK = 4096


@triton.jit
def _chunk_stats(x_ptr, m_ptr, s_ptr, cols, stride, num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride + offs, mask=offs < cols,
                other=float("-inf")).to(tl.float32)
    top = tl.max(x, 0)
    # A chunk of -inf (tokens masked) keeps max -inf; shift by 0 so exp gives 0, not nan.
    shift = tl.where(top == float("-inf"), 0.0, top)
    tl.store(m_ptr + row * num_chunks + chunk, top)
    tl.store(s_ptr + row * num_chunks + chunk, tl.sum(tl.exp(x - shift), 0))


@triton.jit
def _combine_chunks(m_ptr, s_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    ok = c < num_chunks
    m = tl.load(m_ptr + row * num_chunks + c, mask=ok, other=float("-inf"))
    s = tl.load(s_ptr + row * num_chunks + c, mask=ok, other=0.0)
    top = tl.max(m, 0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - shift))
    tl.store(out_ptr + row, shift + tl.log(tl.sum(s * weight, 0)))


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(x), -1)) of each row of a 2-D float tensor, in float32, each row by the
    same operations whatever the other rows (see the module docstring)."""
    if x.dim() != 2:
        raise ValueError(f"logsumexp_rows takes [rows, columns], got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        chunks = max(1, triton.cdiv(cols, _CHUNK))
        stats = torch.empty((2, rows, chunks), dtype=torch.float32, device=x.device)
        _chunk_stats[(rows, chunks)](x, stats[0], stats[1], cols, x.stride(0), chunks,
                                     CHUNK=_CHUNK, num_warps=8, enable_fp_fusion=False)
        _combine_chunks[(rows,)](stats[0], stats[1], out, chunks,
                                 BLOCK_C=triton.next_power_of_2(chunks), num_warps=1,
                                 enable_fp_fusion=False)
    return out
