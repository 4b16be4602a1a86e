"""Rotary position embedding: parameter resolution from HF configs and application."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import torch
from torch import nn

from loom.attention.context import get_forward_context
from loom.errors import UnsupportedModelError
from loom.kernels import elementwise_kernels, rope_neox, use_cpu_kernels

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary parameters for one attention layer type."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # YaRN: the rotation counts bounding the ramp between interpolated (slow) and kept (fast)
    # frequencies, whether its bounds are rounded outwards to whole dimensions, and the
    # factor every cos/sin is multiplied by (`attention_factor`).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


def _spec(theta: float, scaling: dict[str, Any] | None,
          max_position: int | None = None) -> RopeSpec:
    scaling = scaling or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: {_SUPPORTED_ROPE_TYPES}"
        )
    original = int(scaling.get("original_max_position_embeddings") or 8192)
    factor = scaling.get("factor")
    if factor is None and rope_type == "yarn" and max_position:
        factor = max_position / original  # YaRN configs may give the lengths only
    spec = RopeSpec(
        theta=float(scaling.get("rope_theta", theta)),
        rope_type=rope_type,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position=original,
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        truncate=bool(scaling.get("truncate", True)),
    )
    if rope_type == "yarn":
        spec = replace(spec, attention_factor=yarn_attention_factor(spec.factor, scaling))
    return spec


def yarn_attention_factor(factor: float, scaling: dict[str, Any]) -> float:
    """YaRN's cos/sin multiplier: `attention_factor` when the config gives it, else
    0.1 ln(factor) + 1 (as a ratio of two such terms when `mscale` and `mscale_all_dim` are
    both given); 1 for a factor <= 1."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    weight, weight_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if weight and weight_all:
        return float(mscale(float(weight)) / mscale(float(weight_all)))
    return mscale(1.0)


def resolve_rope(t: dict[str, Any], layer_type: str = "full_attention") -> RopeSpec:
    """Rope parameters of `layer_type` from a flat text config (new or legacy HF layout).

    New layout: `rope_parameters` = {rope_theta, rope_type, ...} or {layer_type: {...}}.
    Legacy: `rope_theta` + `rope_scaling`; Gemma 3's sliding layers use `rope_local_base_freq`
    with no scaling.
    """
    params = t.get("rope_parameters")
    max_position = t.get("max_position_embeddings")
    if isinstance(params, dict) and params:
        if layer_type in params and isinstance(params[layer_type], dict):
            params = params[layer_type]
        elif "full_attention" in params and isinstance(params["full_attention"], dict):
            params = params["full_attention"]
        return _spec(float(params.get("rope_theta", 10_000.0)), params, max_position)
    if layer_type == "sliding_attention" and "rope_local_base_freq" in t:
        return RopeSpec(theta=float(t["rope_local_base_freq"]))
    return _spec(float(t.get("rope_theta", 10_000.0)), t.get("rope_scaling"), max_position)


def inverse_frequencies(spec: RopeSpec, rotary_dim: int) -> torch.Tensor:
    """Float32 inverse frequencies [rotary_dim // 2] on the CPU, scaled as `spec` says."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (spec.theta ** (exponents / rotary_dim))
    if spec.rope_type == "linear":
        inv_freq = inv_freq / spec.factor
    elif spec.rope_type == "llama3":
        # Wavelengths above low_wavelen are divided by factor, below high_wavelen kept,
        # and interpolated smoothly in between.
        low_wavelen = spec.original_max_position / spec.low_freq_factor
        high_wavelen = spec.original_max_position / spec.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
        smooth = (spec.original_max_position / wavelen - spec.low_freq_factor) / (
            spec.high_freq_factor - spec.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif spec.rope_type == "yarn":
        inv_freq = _yarn_frequencies(spec, inv_freq, rotary_dim)
    return inv_freq


def _yarn_frequencies(spec: RopeSpec, inv_freq: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """YaRN: frequency i is kept where it turns more than beta_fast times over the original
    context, divided by `factor` where it turns fewer than beta_slow times, and blended
    linearly in between (the ramp over frequency index i, from `low` to `high`):

        keep(i) = 1 - clamp((i - low) / (high - low), 0, 1)
        inv(i)  = inv_freq(i) / factor * (1 - keep(i)) + inv_freq(i) * keep(i)
    """

    def dimension(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times in the original context.
        turns = spec.original_max_position / (rotations * 2 * math.pi)
        return rotary_dim * math.log(turns) / (2 * math.log(spec.theta))

    low, high = dimension(spec.beta_fast), dimension(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    # On the CPU even while the model is built on the meta device.
    index = torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu")
    keep = 1 - torch.clamp((index - low) / (high - low), 0, 1)
    # 1 / (factor * theta^(2i/d)), rounded as the reference rounds it (not inv_freq / factor).
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float()
    interpolated = 1.0 / (spec.factor * spec.theta ** (exponents / rotary_dim))
    return interpolated * (1 - keep) + inv_freq * keep


# Positions per block of `RotaryEmbedding.position_table`.
TABLE_BLOCK = 256


class RotaryEmbedding(nn.Module):
    """Applies rotate-half (NeoX-style) rotary embedding to q [T, H, D] and k [T, Hkv, D]."""

    def __init__(self, head_dim: int, spec: RopeSpec) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.spec = spec
        # Plain attribute (not a buffer): survives meta-device construction and weight loads.
        self._inv_freq = inverse_frequencies(spec, head_dim)
        self._table: torch.Tensor | None = None  # [2 (cos, sin), positions, D], see below

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:
        """Float32 rotation angles [T, D] (each frequency twice, rotate-half order)."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        return torch.cat((freqs, freqs), dim=-1)

    def _cos_sin32(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 cos/sin [T, D], times YaRN's attention factor where it is not 1 (every
        path reads its rows from here: the modules, the kernels and the fused decoder)."""
        emb = self._angles(positions)
        cos, sin = emb.cos(), emb.sin()
        scale = self.spec.attention_factor
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cos, sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos/sin tables [T, 1, D] for absolute positions, computed in float32."""
        cos, sin = self._cos_sin32(positions)
        return cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)

    def position_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 cos/sin rows [T, D] for CPU `positions`, read from a table of every position
        up to the largest seen.

        The table grows in blocks of TABLE_BLOCK positions, each computed by the same call on
        a tensor of the same shape, so a position's row is the same bits whichever step, batch
        or chunk first needs it (torch's vectorised cos and its scalar tail can differ in the
        last bit, and which one an element meets depends on its offset in the call)."""
        needed = int(positions.max()) + 1 if positions.numel() else 0
        table = self._table
        if table is None or table.shape[1] < needed:
            have = 0 if table is None else table.shape[1]
            blocks = [table] if table is not None else []
            # Doubling keeps the copies of a growing table linear in the positions reached.
            for start in range(have, max(needed, 2 * have), TABLE_BLOCK):
                block = torch.arange(start, start + TABLE_BLOCK, dtype=torch.int64)
                blocks.append(torch.stack(self._cos_sin32(block)))
            table = self._table = torch.cat(blocks, dim=1)
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, H, D] and k [T, Hkv, D] by their positions (tables shared by all
        layers of a step), after the per-head RMSNorms `q_norm` / `k_norm` when given (QK-norm
        models); on CUDA each of q and k takes one fused kernel."""
        weights = [n.weight for n in (q_norm, k_norm) if n is not None]
        kernels = elementwise_kernels(q, *weights)
        if kernels is not None and self._fuses(q, q_norm) and self._fuses(k, k_norm):
            cos, sin = self._tables(positions, q.dtype)
            return _norm_rope(kernels, q, q_norm, cos, sin), _norm_rope(kernels, k, k_norm,
                                                                         cos, sin)
        if q_norm is not None:
            q = q_norm(q)
        if k_norm is not None:
            k = k_norm(k)
        cos, sin = self._tables(positions, q.dtype)
        if use_cpu_kernels(q):
            return rope_neox(q.contiguous(), cos, sin), rope_neox(k.contiguous(), cos, sin)
        return _rotate(q, cos[:, None, :], sin[:, None, :]), _rotate(k, cos[:, None, :],
                                                                      sin[:, None, :])

    def _fuses(self, x: torch.Tensor, norm: nn.Module | None = None) -> bool:
        """Whether the fused kernel computes this rotation: a power-of-two head size (one
        tile per head row), and a norm whose result keeps x's dtype."""
        d = self.head_dim
        return d & (d - 1) == 0 and x.shape[-1] == d and (
            norm is None or norm.gemma or norm.weight.dtype == x.dtype
        )

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, D] in `dtype`, made once per step and shared by every layer."""
        try:
            plan_cache = get_forward_context().metadata.plan_cache
        except RuntimeError:
            plan_cache = {}
        key = ("rope", self.spec, self.head_dim, dtype, id(positions))
        tables = plan_cache.get(key)
        if not isinstance(tables, tuple):
            cos, sin = self.cos_sin(positions, dtype)
            t, d = cos.shape[0], cos.shape[-1]
            tables = plan_cache[key] = (cos.view(t, d), sin.view(t, d))
        return tables


def _norm_rope(kernels: ModuleType, x: torch.Tensor, norm: nn.Module | None,
               cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotary(norm(x)) in one Triton launch (`kernels` is loom.kernels.triton_elementwise)."""
    if norm is None:
        return kernels.norm_rope(x, None, 0.0, False, cos, sin)
    return kernels.norm_rope(x, norm.weight, norm.eps, norm.gemma, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
