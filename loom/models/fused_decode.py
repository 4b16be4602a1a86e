"""Steps through one C call for all decoder layers (`loom_decode_layers`).

A decode step computes one token per sequence; in eager PyTorch its cost on a CPU is mostly
per-operation overhead (about 25 small ops per layer, each waking the thread pool). When
every layer of a model has the supported shape (pre-norm or Gemma's sandwich norms, stacked
q/k/v and gate/up projections, float32 or int8 weights, rotate-half RoPE, SiLU, tanh-GELU
or gpt-oss's clamped SwiGLU, attention sinks or none; the feed-forward block a gated MLP or
a mixture of experts of them, which runs as cpu/moe.c's block) and
the KV cache is float32 or float16 on the CPU, `FusedDecoder` runs all layers in a single
call into Loom's C kernels (one OpenMP parallel region for the whole step), with the same
kernels the modules call one by one.

In w4a8 (the default mode for a quantised GGUF) and w8a8 it runs every step, prefill chunks
of any size included: one arithmetic per token (int8 products summed exactly, float
operations in a fixed order per row, attention split at absolute key positions), so a
token's logits are the same bits whatever its chunk, batch or cache history. With float32 or
weight-only int8 weights it runs steps of up to FUSED_MAX_TOKENS tokens and larger ones use
the modules (torch's matmuls).

The descriptors hold raw pointers to the model's weights; the decoder keeps references to
those tensors. Replacing weights after the first decode needs
`CausalLM.invalidate_fused_decoder()`.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn

from loom.attention import AttentionMetadata
from loom.kernels import (
    CLAMPED_SWIGLU_CODE,
    GATED_ACTIVATION_CODES,
    KV_CACHE_KERNEL_DTYPES,
    MOE_SCORING_CODES,
    W4A8_MAX_SEGMENTS,
    cpu_kernels_available,
    load_library,
    use_cpu_kernels,
)
from loom.models.layers import ClampedSwiGLU, GatedMLP, Linear, RMSNorm, SelfAttention
from loom.models.quant import Int8Linear
from loom.models.w4a8 import W4A8Linear

# Outside w8a8, steps with at most this many tokens run fused: decodes, and short chunks
# such as a live append (the attention kernel is causal within a chunk). Longer prefills use
# the modules, where torch's float matmuls pay off.
FUSED_MAX_TOKENS = 32


class _LinearDesc(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32), ("reserved", ctypes.c_int32),
        ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64),
        ("weight", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
    ]


class _LayerDesc(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64),
        ("eps", ctypes.c_float), ("norm_offset", ctypes.c_float),
        ("activation", ctypes.c_int32), ("sandwich_norms", ctypes.c_int32),
        ("attn_scale", ctypes.c_float), ("softcap", ctypes.c_float),
        ("window", ctypes.c_int64),
        ("qkv", _LinearDesc), ("o", _LinearDesc), ("gate_up", _LinearDesc),
        ("down", _LinearDesc),
        ("input_norm", ctypes.c_void_p), ("post_attn_norm", ctypes.c_void_p),
        ("pre_ffn_norm", ctypes.c_void_p), ("post_ffn_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
        ("moe", ctypes.c_void_p),  # a _MoEDesc, or None: the dense gate_up / down
        ("sinks", ctypes.c_void_p),  # float32 [heads], or None: no attention sinks
        ("act_alpha", ctypes.c_float), ("act_limit", ctypes.c_float),
        ("qk_norm_all_heads", ctypes.c_int32),  # 1: the QK-norms span all heads (OLMoE)
    ]


class _MoEDesc(ctypes.Structure):
    """LoomMoE (cpu/moe.c): a mixture-of-experts block; gate_up and down point at arrays of
    num_experts _LinearDesc."""

    _fields_ = [
        ("num_experts", ctypes.c_int64), ("top_k", ctypes.c_int64),
        ("hidden", ctypes.c_int64), ("intermediate", ctypes.c_int64),
        ("renormalize", ctypes.c_int32), ("activation", ctypes.c_int32),
        ("router", ctypes.c_void_p), ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p),
        ("router_bias", ctypes.c_void_p), ("scoring", ctypes.c_int32),
        ("act_alpha", ctypes.c_float), ("act_limit", ctypes.c_float),
    ]


class _W4Segments(ctypes.Structure):
    _fields_ = [
        ("count", ctypes.c_int64), ("types", ctypes.c_int64 * W4A8_MAX_SEGMENTS),
        ("packed", ctypes.c_void_p * W4A8_MAX_SEGMENTS),
        ("columns", ctypes.c_int64 * W4A8_MAX_SEGMENTS),
    ]


class _Unsupported(Exception):
    """A layer the fused path cannot run (the caller keeps the module path)."""


def _f32(t: torch.Tensor | None, keep: list[Any]) -> int | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise _Unsupported(f"tensor {t.dtype} on {t.device} is not contiguous CPU float32")
    keep.append(t)
    return t.data_ptr()


def _linear(module: nn.Module | None, keep: list[Any]) -> _LinearDesc:
    if isinstance(module, W4A8Linear):
        segments = module.segments()
        if len(segments) > W4A8_MAX_SEGMENTS:
            raise _Unsupported(f"w4a8 layer of {len(segments)} segments")
        desc = _W4Segments(len(segments))
        for i, (type_id, packed, columns) in enumerate(segments):
            keep.append(packed)
            desc.types[i], desc.packed[i], desc.columns[i] = type_id, packed.data_ptr(), columns
        keep.append(desc)  # the layer descriptor points at it
        return _LinearDesc(3, 0, module.in_features, module.out_features,
                           ctypes.addressof(desc), None, _f32(module.bias, keep))
    if isinstance(module, Int8Linear):
        keep.append(module.weight_q)
        if module.quantize_activations and module.layout != "packed":
            raise _Unsupported("w8a8 weight not packed for the kernels")
        kind = 2 if module.quantize_activations else 1
        return _LinearDesc(
            kind, 0, module.in_features, module.out_features, module.weight_q.data_ptr(),
            _f32(module.scales_f32, keep), _f32(module.bias, keep),
        )
    if isinstance(module, Linear) and module.weight.dtype == torch.float32:
        return _LinearDesc(
            0, 0, module.in_features, module.out_features, _f32(module.weight.data, keep), None,
            _f32(None if module.bias is None else module.bias.data, keep),
        )
    raise _Unsupported(f"linear layer {type(module).__name__} is not float32 or int8")


def _norm(module: Any, keep: list[Any]) -> tuple[int | None, float, float]:
    if module is None:
        return None, 0.0, 0.0
    if not isinstance(module, RMSNorm):
        raise _Unsupported(f"norm {type(module).__name__} is not RMSNorm")
    return _f32(module.weight.data, keep), (1.0 if module.gemma else 0.0), module.eps


def _activation(module: nn.Module) -> tuple[int, float, float]:
    """(code, alpha, limit) of a gated MLP's or block's activation (cpu/decoder_layer.c's
    GatedAct): a name of GATED_ACTIVATION_CODES, or gpt-oss's clamped SwiGLU."""
    activation = module.activation
    if isinstance(activation, ClampedSwiGLU):
        return CLAMPED_SWIGLU_CODE, activation.alpha, activation.limit
    code = GATED_ACTIVATION_CODES.get(activation) if isinstance(activation, str) else None
    if code is None:
        raise _Unsupported(f"activation {activation!r}")
    return code, 0.0, 0.0


def is_sparse_moe(module: object) -> bool:
    """Whether `module` is a mixture-of-experts block (loom.models.moe.SparseMoE), told by
    its attributes: this module imports nothing from loom.models.moe, so that moe.py may
    import the kernel form (loom.models.moe_kernel, which imports this module)."""
    return all(hasattr(module, name) for name in
               ("gate", "experts", "top_k", "renormalize", "num_experts", "route"))


def describe_moe(moe: nn.Module, keep: list[Any]) -> _MoEDesc:
    """The C descriptor of a SparseMoE block: its float32 router and each expert's stacked
    gate_up and down projections as the fused decoder's linear kinds (`keep` receives every
    object the descriptor points into, which must outlive it)."""
    router = getattr(moe.gate, "weight", None)
    if not isinstance(router, torch.Tensor) or router.shape != (moe.num_experts,
                                                                 moe.hidden_size):
        raise _Unsupported("the router has no [experts, hidden] weight")
    scoring = MOE_SCORING_CODES.get(getattr(moe, "scoring", "softmax"))
    if scoring is None:
        raise _Unsupported(f"routing by {moe.scoring!r}")
    router_bias = getattr(moe.gate, "bias", None)
    experts = list(moe.experts)
    if len(experts) != moe.num_experts:
        raise _Unsupported(f"{len(experts)} expert modules for {moe.num_experts} experts")
    # The experts' width from their layers: a tensor-parallel rank's experts hold a slice
    # of the block's intermediate_size (its partial sum is all-reduced after the block).
    gate_up, down, widths = [], [], set()
    for expert in experts:
        if not isinstance(expert, GatedMLP) or expert.gate_up_proj is None:
            raise _Unsupported("an expert is not a gated MLP with stacked gate/up projections")
        if _activation(expert) != _activation(moe):
            raise _Unsupported("an expert's activation differs from the block's")
        gu, dn = _linear(expert.gate_up_proj, keep), _linear(expert.down_proj, keep)
        shapes = (gu.in_features, gu.out_features, dn.in_features, dn.out_features)
        if shapes != (moe.hidden_size, 2 * dn.in_features, dn.in_features, moe.hidden_size):
            raise _Unsupported(f"an expert's projections have shapes {shapes}")
        widths.add(dn.in_features)
        gate_up.append(gu)
        down.append(dn)
    if len(widths) != 1:
        raise _Unsupported(f"experts of different widths {sorted(widths)}")
    gate_up_array = (_LinearDesc * len(gate_up))(*gate_up)
    down_array = (_LinearDesc * len(down))(*down)
    keep += [gate_up_array, down_array]
    code, alpha, limit = _activation(moe)
    desc = _MoEDesc(
        num_experts=moe.num_experts, top_k=moe.top_k, hidden=moe.hidden_size,
        intermediate=widths.pop(), renormalize=int(bool(moe.renormalize)),
        activation=code, router=_f32(router.data, keep),
        gate_up=ctypes.addressof(gate_up_array), down=ctypes.addressof(down_array),
        router_bias=_f32(None if router_bias is None else router_bias.data, keep),
        scoring=scoring, act_alpha=alpha, act_limit=limit,
    )
    keep.append(desc)  # the layer descriptor (or MoEKernel) points at it
    return desc


def _describe(layer: nn.Module, keep: list[Any]) -> _LayerDesc:
    roles = getattr(layer, "norm_roles", None)
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    moe = is_sparse_moe(mlp)
    if roles is None or not isinstance(attn, SelfAttention) or not (
            moe or isinstance(mlp, GatedMLP)):
        raise _Unsupported(f"{type(layer).__name__} has no fused decode layout")
    if attn.qkv_proj is None or (not moe and mlp.gate_up_proj is None):
        raise _Unsupported("projections are not stacked (run fuse_projections first)")
    code, alpha, limit = _activation(mlp)
    if moe:  # the experts replace gate_up / down (left zero: never read)
        moe_desc = describe_moe(mlp, keep)
        intermediate, gate_up, down = moe_desc.intermediate, _LinearDesc(), _LinearDesc()
    else:
        moe_desc, intermediate = None, mlp.down_proj.in_features
        gate_up, down = _linear(mlp.gate_up_proj, keep), _linear(mlp.down_proj, keep)
    norms = {role: _norm(getattr(layer, name), keep) for role, name in roles.items()}
    q_norm, k_norm = _norm(attn.q_norm, keep), _norm(attn.k_norm, keep)
    offsets = {off for ptr, off, _ in [*norms.values(), q_norm, k_norm] if ptr is not None}
    epsilons = {eps for ptr, _, eps in [*norms.values(), q_norm, k_norm] if ptr is not None}
    if len(offsets) != 1 or len(epsilons) != 1:
        raise _Unsupported("norms of one layer differ in offset or epsilon")
    sandwich = "post_attn" in norms
    if sandwich != ("post_ffn" in norms):
        raise _Unsupported("post-attention norm without post-feedforward norm")
    spec = attn.attn.spec
    return _LayerDesc(
        hidden=attn.o_proj.out_features, heads=spec.num_heads, kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, intermediate=intermediate,
        eps=epsilons.pop(), norm_offset=offsets.pop(), activation=code,
        sandwich_norms=int(sandwich), attn_scale=spec.scale, softcap=spec.logit_softcap or 0.0,
        window=spec.sliding_window or 0,
        qkv=_linear(attn.qkv_proj, keep), o=_linear(attn.o_proj, keep),
        gate_up=gate_up, down=down,
        input_norm=norms["input"][0], pre_ffn_norm=norms["pre_ffn"][0],
        post_attn_norm=norms.get("post_attn", (None,))[0],
        post_ffn_norm=norms.get("post_ffn", (None,))[0],
        q_norm=q_norm[0], k_norm=k_norm[0],
        moe=None if moe_desc is None else ctypes.addressof(moe_desc),
        sinks=_f32(None if attn.sinks is None else attn.sinks.data, keep),
        act_alpha=alpha, act_limit=limit, qk_norm_all_heads=int(attn.qk_norm_all_heads),
    )


def _all_w8a8(layers: list[nn.Module]) -> bool:
    """Every linear layer is w8a8 (or w4a8) on the kernels and none multiplies large calls
    in another dtype (an explicit bf16 prefill keeps large steps on the modules): one
    arithmetic for any number of rows. A mixture of experts' router is no nn.Linear (not
    counted): it is float32 through f32_body, one arithmetic for any number of rows too."""
    linears = [m for layer in layers for m in layer.modules()
               if isinstance(m, nn.Linear | Int8Linear | W4A8Linear)]
    return bool(linears) and all(
        isinstance(m, W4A8Linear) or (
            isinstance(m, Int8Linear) and m.layout == "packed"
            and m.large_batch_dtype == torch.float32)
        for m in linears
    )


class FusedDecoder:
    """Runs a step's decoder layers in one C call (any step in w8a8, else small ones)."""

    def __init__(self, layers: list[nn.Module], descs: list[_LayerDesc],
                 keep: list[Any], any_size: bool = False) -> None:
        """`any_size`: run steps of any number of tokens (w8a8 layers), else at most
        FUSED_MAX_TOKENS."""
        self.layers = layers
        self._descs = (_LayerDesc * len(descs))(*descs)
        self._keep = keep  # the tensors the descriptors point into stay alive
        lib = load_library()
        assert lib is not None
        self._fn = lib.loom_decode_layers
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [
            ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, ptr, i64, i64, i64,
        ]
        self._fn.restype = None
        self.max_tokens = None if any_size else FUSED_MAX_TOKENS
        # Layers sharing a rotary spec share cos/sin rows (Gemma: local and global), read each
        # step from the rotary's position table.
        self._rotaries: dict[object, Any] = {}
        self._rope_slot: list[int] = []
        for layer in layers:
            rotary = layer.self_attn.rotary
            key = (rotary.spec, rotary.head_dim)
            self._rotaries.setdefault(key, rotary)
            self._rope_slot.append(list(self._rotaries).index(key))
        self._cache_ptrs: tuple[tuple[int, ...], ctypes.Array, ctypes.Array] | None = None

    @classmethod
    def build(cls, layers: list[nn.Module]) -> tuple[FusedDecoder | None, str]:
        """A decoder for these layers, or None and the reason the module path must be used."""
        if not cpu_kernels_available():
            return None, "CPU kernels unavailable"
        if any(p.requires_grad for layer in layers for p in layer.parameters()):
            return None, "parameters require gradients (call model.requires_grad_(False))"
        keep: list[Any] = []
        try:
            descs = [_describe(layer, keep) for layer in layers]
        except _Unsupported as exc:
            return None, str(exc)
        return cls(list(layers), descs, keep, any_size=_all_w8a8(layers)), "ok"

    def applies(self, hidden: torch.Tensor, md: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> bool:
        """True for a step within `max_tokens` (any step in w8a8; else decodes and short
        appends) on float32 CPU tensors with nothing for autograd (the decoder is built only
        over layers whose parameters do not require gradients), with float32 or float16 KV
        caches."""
        return (
            (self.max_tokens is None or md.num_tokens <= self.max_tokens)
            and use_cpu_kernels(hidden)
            and len({c.dtype for c in kv_caches}) == 1
            and all(c.dtype in KV_CACHE_KERNEL_DTYPES and c.is_contiguous() for c in kv_caches)
        )

    def _caches(self, kv_caches: list[torch.Tensor]) -> tuple[ctypes.Array, ctypes.Array]:
        # Keyed by every cache's address: a new runner may get some of a freed one's addresses.
        key = tuple(c.data_ptr() for c in kv_caches)
        if self._cache_ptrs is None or self._cache_ptrs[0] != key:
            n = len(kv_caches)
            k_ptrs = (ctypes.c_void_p * n)(*[c[0].data_ptr() for c in kv_caches])
            v_ptrs = (ctypes.c_void_p * n)(*[c[1].data_ptr() for c in kv_caches])
            self._cache_ptrs = (key, k_ptrs, v_ptrs)
        return self._cache_ptrs[1], self._cache_ptrs[2]

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
            kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """hidden [T, H] (the step's new tokens) through every layer; returns a new tensor."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.layers)} layers")
        x = hidden.contiguous().clone()
        m = x.shape[0]
        # The K/V of all the step's tokens are written before any of them attends; a chunk's
        # tokens attend causally (each up to its own position).
        tables, seq_lens = md.block_tables.contiguous(), md.seq_lens.contiguous()
        q_start = md.query_start_loc.contiguous()
        slots = md.slot_mapping.contiguous()
        rope = [rotary.position_table(positions) for rotary in self._rotaries.values()]
        n = len(self.layers)
        cos_ptrs = (ctypes.c_void_p * n)(*[rope[i][0].data_ptr() for i in self._rope_slot])
        sin_ptrs = (ctypes.c_void_p * n)(*[rope[i][1].data_ptr() for i in self._rope_slot])
        k_ptrs, v_ptrs = self._caches(kv_caches)
        self._fn(
            ctypes.addressof(self._descs), n, x.data_ptr(), m, cos_ptrs, sin_ptrs,
            k_ptrs, v_ptrs, slots.data_ptr(), q_start.data_ptr(), md.num_seqs, tables.data_ptr(),
            tables.shape[1], seq_lens.data_ptr(), md.block_size, max(md.seq_lens_list),
            int(kv_caches[0].dtype == torch.float16),
        )
        return x
