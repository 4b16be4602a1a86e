"""Gemma 3 text model: interleaved sliding/global attention, QK-norm, four norms per layer."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from loom.attention import AttentionSpec
from loom.models.base import CausalLM, DecoderBody
from loom.models.config import ModelConfig
from loom.models.layers import GatedMLP, RMSNorm, SelfAttention, empty_embedding
from loom.models.rope import resolve_rope


def gemma3_layer_types(t: dict[str, Any], num_layers: int) -> list[str]:
    """`layer_types`, or from the pattern: every p-th layer (1-based) global, others sliding."""
    if t.get("layer_types"):
        return list(t["layer_types"])
    pattern = int(t.get("sliding_window_pattern") or t.get("_sliding_window_pattern") or 6)
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


class Gemma3DecoderLayer(nn.Module):
    """x + post_attn_norm(attn(in_norm(x))), then x + post_ffw_norm(mlp(pre_ffw_norm(x)))."""

    # Which norm plays which role, for the fused decode path (loom/models/fused_decode.py).
    norm_roles: ClassVar[dict[str, str]] = {
        "input": "input_layernorm",
        "post_attn": "post_attention_layernorm",
        "pre_ffn": "pre_feedforward_layernorm",
        "post_ffn": "post_feedforward_layernorm",
    }

    def __init__(self, layer_idx: int, t: dict[str, Any], config: ModelConfig, kind: str) -> None:
        super().__init__()
        eps = float(t["rms_norm_eps"])
        hidden = config.hidden_size
        spec = AttentionSpec(
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            scale=float(t["query_pre_attn_scalar"]) ** -0.5,
            sliding_window=int(t["sliding_window"]) if kind == "sliding_attention" else None,
            # No attention softcap: the reference (HF Gemma3Attention) never applies
            # attn_logit_softcapping, and released Gemma 3 configs leave it null.
        )
        self.self_attn = SelfAttention(
            layer_idx, hidden, spec, resolve_rope(t, kind),
            qkv_bias=bool(t.get("attention_bias", False)),
            o_bias=bool(t.get("attention_bias", False)),
            qk_norm_eps=eps, gemma_norm=True,
        )
        self.mlp = GatedMLP(hidden, int(t["intermediate_size"]), t["hidden_activation"])
        self.input_layernorm = RMSNorm(hidden, eps, gemma=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, gemma=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, gemma=True)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, gemma=True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One decoder block."""
        x = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x)), x)
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)), x)


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text-only checkpoints (270M, 1B) and GGUF conversions."""

    def __init__(self, config: ModelConfig) -> None:
        t = config.text
        kinds = gemma3_layer_types(t, config.num_layers)
        layers = [
            Gemma3DecoderLayer(i, t, config, kinds[i]) for i in range(config.num_layers)
        ]
        body = DecoderBody(
            empty_embedding(config.vocab_size, config.hidden_size),
            layers,
            RMSNorm(config.hidden_size, float(t["rms_norm_eps"]), gemma=True),
        )
        super().__init__(config, body, tie_embeddings=bool(t.get("tie_word_embeddings", True)))
        self.embed_scale = config.hidden_size**0.5
        self.final_softcap = t.get("final_logit_softcapping")


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text part of multimodal Gemma 3 checkpoints; vision weights are skipped."""

    ignored_prefixes = (
        "vision_tower.", "multi_modal_projector.",
        "model.vision_tower.", "model.multi_modal_projector.",
    )

    def map_weight_name(self, name: str) -> str | None:
        """Strip the language-model prefix (old and new HF layouts)."""
        for prefix, repl in (
            ("language_model.model.", "model."),
            ("model.language_model.", "model."),
            ("language_model.lm_head.", "lm_head."),
        ):
            if name.startswith(prefix):
                name = repl + name[len(prefix):]
                break
        return super().map_weight_name(name)
