"""The elementwise chains of a decoder layer as single Triton kernels (the CUDA path).

Written with torch ops, a Gemma 3 layer's norms, rotary and gated activation launch about
70 small kernels (float32 casts, pow, mean, rsqrt, adds, muls, casts back), and those
launches, not the weight reads, were most of a decode step on an H100. Here each chain is
one launch:

    rms_norm      out = norm(x) (+ residual)                       one program per row
    norm_rope     rotary(norm(x)) for q or k, norm optional         one program per head row
    gated_act     act(gate) * up from the stacked [gate | up] rows  programs over columns

Every kernel rounds where the torch definition (loom.models.layers / rope) rounds: the
statistics in float32, the result cast to the activation dtype at the same points, so the
outputs differ from the torch ops only in the float32 summation order of the mean (and the
last float32 bit of tanh). They compile without floating-point contraction
(enable_fp_fusion=False): fused into one multiply-add, `round(x * c) + y` would skip the
rounding the torch definition makes. Triton's interpreter runs them on a CPU (tests).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from loom.kernels.triton_attention import exp_tanh

# LOOM_TRITON_ELEMENTWISE=0 runs the torch definitions on CUDA instead (for comparisons).
ENABLED = os.environ.get("LOOM_TRITON_ELEMENTWISE", "1") != "0"

# Activations gated_act computes (the names of loom.models.layers._ACTIVATIONS).
ACTIVATION_CODES = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}

# Columns of the gated activation per program.
_ACT_BLOCK = 1024


def use_triton_elementwise(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """Whether an op on CUDA tensor `x` runs on these kernels: enabled, and autograd has
    nothing to record (the kernels have no backward)."""
    return (
        ENABLED
        and x.is_cuda
        and not (
            torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
        )
    )


@triton.jit
def _normalise(x, w, count, eps, GEMMA: tl.constexpr, OUT: tl.constexpr):
    """norm(x) of one float32 row, rounded as RMSNorm rounds: Gemma (x * r * (1 + w)) cast
    once; otherwise w * cast(x * r), cast again."""
    r = tl.rsqrt(tl.sum(x * x, axis=0) / count + eps)
    if GEMMA:
        return (x * r * (1.0 + w)).to(OUT)
    return (w * (x * r).to(OUT).to(tl.float32)).to(OUT)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, res_ptr, out_ptr, dim, x_stride, res_stride, out_stride,
                     eps, GEMMA: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    y = _normalise(x, w, dim, eps, GEMMA, out_ty)
    if HAS_RES:
        res = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        y = (res.to(tl.float32) + y.to(tl.float32)).to(out_ty)
    tl.store(out_ptr + row * out_stride + cols, y, mask=mask)


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, x_tok_stride, x_head_stride,
                      heads, eps, HEAD_DIM: tl.constexpr, NORM: tl.constexpr,
                      GEMMA: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    cols = tl.arange(0, HEAD_DIM)
    # Rotate-half: element d pairs with d + half (negated) below half, d - half above.
    partner = (cols + half) % HEAD_DIM
    base = x_ptr + tok * x_tok_stride + head * x_head_stride
    x = tl.load(base + cols).to(tl.float32)
    xp = tl.load(base + partner).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    if NORM:
        r = tl.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
        w = tl.load(w_ptr + cols).to(tl.float32)
        wp = tl.load(w_ptr + partner).to(tl.float32)
        if GEMMA:
            x = (x * r * (1.0 + w)).to(out_ty).to(tl.float32)
            xp = (xp * r * (1.0 + wp)).to(out_ty).to(tl.float32)
        else:
            x = (w * (x * r).to(out_ty).to(tl.float32)).to(out_ty).to(tl.float32)
            xp = (wp * (xp * r).to(out_ty).to(tl.float32)).to(out_ty).to(tl.float32)
    else:
        x = x.to(out_ty).to(tl.float32)
        xp = xp.to(out_ty).to(tl.float32)
    rotated = tl.where(cols < half, -xp, xp)
    cos = tl.load(cos_ptr + tok * HEAD_DIM + cols)
    sin = tl.load(sin_ptr + tok * HEAD_DIM + cols)
    a = (x * cos.to(tl.float32)).to(out_ty).to(tl.float32)
    b = (rotated * sin.to(tl.float32)).to(out_ty).to(tl.float32)
    tl.store(out_ptr + (tok * heads + head) * HEAD_DIM + cols, (a + b).to(out_ty))


@triton.jit
def _gated_act_kernel(x_ptr, out_ptr, width, x_stride, ACT: tl.constexpr,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    if ACT == 0:
        act = gate / (1.0 + tl.exp(-gate))
    else:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (1.0 + exp_tanh(inner))
    y = (act.to(out_ty).to(tl.float32) * up).to(out_ty)
    tl.store(out_ptr + row * width + cols, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of `x` [..., D] (last dimension contiguous), plus `residual`."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    res = out if residual is None else residual.reshape(-1, dim)
    if res.stride(-1) != 1:
        res = res.contiguous()
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, res, out, dim, rows.stride(0), res.stride(0), out.stride(0), eps,
            GEMMA=gemma, HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(dim),
            enable_fp_fusion=False,
        )
    return out.view(x.shape)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, gemma: bool,
              cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary of x [T, H, D] (each head row contiguous; token and head strides
    free, as in a split of the stacked qkv output), after an RMSNorm over D when `weight`
    is given. cos/sin: [T, D] contiguous. Returns a contiguous [T, H, D]."""
    t, heads, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((t, heads, dim), dtype=x.dtype, device=x.device)
    if t:
        _norm_rope_kernel[(t, heads)](
            x, x if weight is None else weight, cos, sin, out, x.stride(0), x.stride(1),
            heads, eps, HEAD_DIM=dim, NORM=weight is not None, GEMMA=gemma,
            enable_fp_fusion=False,
        )
    return out


def gated_act(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for rows [gate | up] of `gate_up` [T, 2I] -> [T, I]."""
    t, double = gate_up.shape
    width = double // 2
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty((t, width), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        grid = (t, triton.cdiv(width, _ACT_BLOCK))
        _gated_act_kernel[grid](gate_up, out, width, gate_up.stride(0),
                                ACT=ACTIVATION_CODES[activation], BLOCK=_ACT_BLOCK,
                                enable_fp_fusion=False)
    return out
