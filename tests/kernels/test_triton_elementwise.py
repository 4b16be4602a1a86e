"""The fused Triton norm / rotary / gated-activation kernels against the torch definitions
(loom.models.layers and rope with the kernels switched off).

With CUDA they run compiled, reached through the modules' own dispatch; without it, called
directly in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from loom.kernels import elementwise_kernels
from loom.kernels import triton_elementwise as kernels
from loom.models.layers import GatedMLP, RMSNorm
from loom.models.rope import RopeSpec, RotaryEmbedding, _rotate

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def torch_definitions(monkeypatch):
    """Run the modules' torch definitions (the reference) even on CUDA."""
    monkeypatch.setattr(kernels, "ENABLED", False)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal up to rounding: the kernels sum the mean of squares in another order (the last
    float32 bit of the scale), which can move a rounded bfloat16 result by one unit in its
    last place (at most 2**-7 of the largest value), and only rarely.

    Triton's interpreter truncates where the GPU rounds to nearest when it casts to bfloat16,
    at each of a kernel's casts: there the bound is four such units and no rarity."""
    assert got.dtype == want.dtype and got.shape == want.shape
    got, want = got.float(), want.float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    units = 1 if DEVICE == "cuda" else 4
    torch.testing.assert_close(got, want, atol=float(want.abs().max()) * 2**-7 * units, rtol=0)
    if DEVICE == "cuda":
        assert (got != want).float().mean() < 0.02


def _norm(dim: int, gemma: bool, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, gemma=gemma)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(seed)))
    return norm.to(DEVICE, dtype).requires_grad_(False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_equals_the_torch_definition(dtype, gemma, with_residual, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(7, 640, generator=gen)).to(DEVICE, dtype)
    residual = torch.randn(7, 640, generator=gen).to(DEVICE, dtype) if with_residual else None
    norm = _norm(640, gemma, dtype, seed=2)
    got = kernels.rms_norm(x, norm.weight, norm.eps, gemma, residual)
    if DEVICE == "cuda":  # the module's own dispatch takes the kernel
        _close(norm(x, residual), got, dtype)
    monkeypatch.setattr(kernels, "ENABLED", False)
    # The torch definition, not the CPU's C kernel (the reference the CUDA path follows).
    want = _torch_rms_norm(norm, x, residual)
    _close(got, want, dtype)


def _torch_rms_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    out = (h * (1.0 + norm.weight.float())).to(x.dtype) if norm.gemma else (
        norm.weight * h.to(x.dtype))
    return out if residual is None else residual + out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [None, "gemma", "plain"])
def test_norm_rope_equals_norm_then_rotary(dtype, qk_norm, torch_definitions):
    """q and k as views of one stacked qkv output (token stride over all three), normed per
    head (or not), rotated at scattered positions."""
    heads, kv_heads, dim, tokens = 4, 2, 64, 5
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE, dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim)
    positions = torch.tensor([0, 7, 300, 1, 4095], device=DEVICE)
    rotary = RotaryEmbedding(dim, RopeSpec(theta=10_000.0))
    norms = [None, None] if qk_norm is None else [
        _norm(dim, qk_norm == "gemma", dtype, seed) for seed in (4, 5)]
    cos, sin = rotary.cos_sin(positions, dtype)
    for x, norm in zip((q, k), norms, strict=True):
        normed = x if norm is None else _torch_rms_norm(norm, x, None)
        want = _rotate(normed, cos, sin)
        got = kernels.norm_rope(x, None if norm is None else norm.weight,
                                0.0 if norm is None else norm.eps,
                                norm is not None and norm.gemma, cos[:, 0], sin[:, 0])
        assert got.is_contiguous()
        _close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_gated_act_equals_the_torch_definition(dtype, activation, torch_definitions):
    mlp = GatedMLP(16, 1500, activation)  # a width that is not a multiple of the tile
    gen = torch.Generator().manual_seed(6)
    gate_up = (2 * torch.randn(3, 3000, generator=gen)).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(kernels.gated_act(gate_up, activation), mlp.act(gate) * up, dtype)


def test_kernels_are_chosen_for_cuda_tensors_only(monkeypatch):
    x = torch.ones(2, 4)
    assert elementwise_kernels(x) is None
    monkeypatch.setattr(kernels, "ENABLED", True)
    if torch.cuda.is_available():
        y = x.cuda()
        assert elementwise_kernels(y) is kernels
        trained = torch.nn.Parameter(torch.ones(4, device="cuda"))
        assert elementwise_kernels(y, trained) is None  # autograd would have nothing to record
        monkeypatch.setattr(kernels, "ENABLED", False)
        assert elementwise_kernels(y) is None
