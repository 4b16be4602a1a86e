"""Llama 2/3 and Qwen2 (QKV bias) decoder: pre-norm attention and gated MLP."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from loom.attention import AttentionSpec
from loom.models.base import CausalLM, DecoderBody
from loom.models.config import ModelConfig
from loom.models.layers import GatedMLP, RMSNorm, SelfAttention, empty_embedding
from loom.models.rope import resolve_rope


def layer_windows(t: dict[str, Any], num_layers: int) -> list[int | None]:
    """Sliding window per layer from `layer_types` (None = full attention)."""
    types = t.get("layer_types") or ["full_attention"] * num_layers
    window = t.get("sliding_window")
    if t.get("use_sliding_window") is False or not window:
        return [None] * num_layers
    return [int(window) if ty == "sliding_attention" else None for ty in types]


class LlamaDecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)) (mlp: a gated MLP or a mixture of experts)."""

    # Which norm plays which role, for the fused decode path (loom/models/fused_decode.py).
    norm_roles: ClassVar[dict[str, str]] = {
        "input": "input_layernorm",
        "pre_ffn": "post_attention_layernorm",
    }

    def __init__(
        self,
        layer_idx: int,
        t: dict[str, Any],
        config: ModelConfig,
        window: int | None,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        qk_norm_all_heads: bool = False,
        mlp: nn.Module | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        eps = float(t["rms_norm_eps"])
        spec = AttentionSpec(
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            scale=config.head_dim**-0.5,
            sliding_window=window,
        )
        layer_type = "sliding_attention" if window else "full_attention"
        self.self_attn = SelfAttention(
            layer_idx, config.hidden_size, spec, resolve_rope(t, layer_type),
            qkv_bias=qkv_bias, o_bias=o_bias, qk_norm_eps=eps if qk_norm else None,
            qk_norm_all_heads=qk_norm_all_heads, sinks=sinks,
        )
        # The feed-forward block: the dense gated MLP, or what the architecture gives
        # (a mixture of experts, `loom.models.moe`).
        self.mlp = mlp if mlp is not None else GatedMLP(
            config.hidden_size, int(t["intermediate_size"]), t["hidden_act"])
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One decoder block."""
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalLM):
    """Llama 2/3 family (also the base of Qwen2 and Qwen3)."""

    qkv_bias_default = False
    qk_norm = False
    qk_norm_all_heads = False  # the QK-norm spans all heads at once (OLMoE), not each head
    attention_sinks = False  # a learned sink logit per head (`self_attn.sinks`)

    def __init__(self, config: ModelConfig) -> None:
        t = config.text
        attn_bias = bool(t.get("attention_bias", self.qkv_bias_default))
        qkv_bias = attn_bias or self.qkv_bias_default
        # Llama's attention_bias also covers o_proj; Qwen2 biases q/k/v only.
        o_bias = attn_bias and not self.qkv_bias_default
        windows = layer_windows(t, config.num_layers)
        layers = [
            LlamaDecoderLayer(
                i, t, config, windows[i], qkv_bias=qkv_bias, o_bias=o_bias,
                qk_norm=self.qk_norm, qk_norm_all_heads=self.qk_norm_all_heads,
                mlp=self.feed_forward(i, t, config),
                sinks=self.attention_sinks,
            )
            for i in range(config.num_layers)
        ]
        body = DecoderBody(
            empty_embedding(config.vocab_size, config.hidden_size),
            layers,
            RMSNorm(config.hidden_size, float(t["rms_norm_eps"])),
        )
        super().__init__(config, body, tie_embeddings=bool(t.get("tie_word_embeddings", False)))

    @classmethod
    def feed_forward(cls, layer_idx: int, t: dict[str, Any],
                     config: ModelConfig) -> nn.Module | None:
        """Layer `layer_idx`'s feed-forward block where it is not the dense gated MLP (None:
        the dense one). Mixture-of-experts architectures override it."""
        return None


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on the q/k/v projections."""

    qkv_bias_default = True
