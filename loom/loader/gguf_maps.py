"""GGUF -> HF translation tables (data only)."""

from __future__ import annotations

from typing import Any

# GGUF `general.architecture` -> (HF architectures name, HF model_type).
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss"),
    "llama": ("LlamaForCausalLM", "llama"),
    "olmoe": ("OlmoeForCausalLM", "olmoe"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}

# Architectures whose files with expert tensors (`{arch}.expert_count` > 0) are another HF
# architecture: llama.cpp writes Mixtral as "llama".
GGUF_EXPERT_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("MixtralForCausalLM", "mixtral"),
}

# `{arch}.<key>` metadata -> HF config key (shared by all architectures above).
GGUF_CONFIG_KEYS: dict[str, str] = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_weights_norm": "norm_topk_prob",
}

# Architecture-specific overrides of (and additions to) GGUF_CONFIG_KEYS. gpt-oss's experts
# are its only feed-forward blocks: HF's `intermediate_size` is their width.
GGUF_CONFIG_KEYS_OVERRIDES: dict[str, dict[str, str]] = {
    "gpt-oss": {"expert_feed_forward_length": "intermediate_size"},
    # OLMoE's experts are its only feed-forward blocks too; its clamp of q, k and v is read
    # so that a file that sets it is refused, not run without it.
    "olmoe": {"expert_feed_forward_length": "intermediate_size",
              "attention.clamp_kqv": "clip_qkv"},
}

# `{arch}.rope.scaling.<key>` metadata -> key of HF `rope_scaling` (beside its rope_type).
GGUF_ROPE_SCALING_KEYS: dict[str, str] = {
    "factor": "factor",
    "original_context_length": "original_max_position_embeddings",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}

# Per-architecture `rope_scaling` values a file may not store. gpt-oss's config: YaRN's
# ramp of 32 to 1 rotations with unrounded ends (llama.cpp rounds them outwards to whole
# dimensions; Loom follows the model's own config, as transformers does).
GGUF_ROPE_SCALING_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt-oss": {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
}

# Architectures whose layers alternate sliding-window and full attention with this period,
# which GGUF does not store: layer i is full where i % period == period - 1, else sliding
# (llama.cpp's `set_swa_pattern(2)` for gpt-oss: even layers slide). Becomes `layer_types`.
GGUF_SLIDING_PERIOD: dict[str, int] = {"gpt-oss": 2}

# Tokenizer metadata -> HF config key.
GGUF_TOKEN_ID_KEYS: dict[str, str] = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}

# Per-architecture constants that GGUF does not store (HF config-class defaults).
GGUF_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3": {
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_local_base_freq": 10_000.0,
        "sliding_window_pattern": 6,  # 5 sliding layers, then 1 global
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    },
    # gpt-oss: biased q/k/v/o, experts gated by the clamped SwiGLU of these constants
    # (llama.cpp hard-codes them too).
    "gpt-oss": {"attention_bias": True, "swiglu_alpha": 1.702, "swiglu_limit": 7.0},
    "llama": {"hidden_act": "silu"},
    # llama.cpp weights an olmoe file's chosen experts by their softmax probabilities, not
    # renormalised (as OLMoE's config says).
    "olmoe": {"hidden_act": "silu", "norm_topk_prob": False},
    "qwen2": {"hidden_act": "silu"},
    "qwen3": {"hidden_act": "silu"},
    # llama.cpp renormalises the chosen experts' weights of every qwen3moe file.
    "qwen3moe": {"hidden_act": "silu", "norm_topk_prob": True},
}

# Non-layer tensors: GGUF name -> HF name.
GGUF_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# `blk.{i}.<suffix>` -> `model.layers.{i}.<suffix>`; the .weight / .bias ending is kept.
GGUF_LAYER_TENSORS: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
}

# Expert tensors: `blk.{i}.<kind>.weight` is 3-D [experts, rows, columns] and becomes one
# tensor per expert, `model.layers.{i}.mlp.experts.{e}.<projection>.weight`; a `.bias`
# (gpt-oss) is 2-D [experts, rows] and becomes one bias per expert the same way. Files from
# older converters store each expert as its own 2-D tensor `blk.{i}.<dense kind>.{e}.weight`.
GGUF_EXPERT_TENSORS: dict[str, str] = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# Fused expert tensors (llama.cpp's converter writes them with `--fuse_gate_up_exps`, 2026):
# `blk.{i}.ffn_gate_up_exps.weight` is [experts, 2 x rows, columns], each expert's gate rows
# then its up rows (llama.cpp computes both in one product and splits the result in halves,
# the gate's first); its `.bias` [experts, 2 x rows] is split the same way.
GGUF_FUSED_EXPERT_TENSORS: dict[str, tuple[str, ...]] = {
    "ffn_gate_up_exps": ("gate_proj", "up_proj"),
}
GGUF_SPLIT_EXPERT_TENSORS: dict[str, str] = {
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}

# Architecture-specific overrides of GGUF_LAYER_TENSORS (Gemma's sandwich norms; gpt-oss's
# pre-feed-forward norm, which llama.cpp names post_attention_norm, and attention sinks).
GGUF_LAYER_TENSORS_OVERRIDES: dict[str, dict[str, str]] = {
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "gpt-oss": {
        "post_attention_norm": "post_attention_layernorm",
        "attn_sinks": "self_attn.sinks",
    },
}

# Layer tensors whose HF name is a parameter of its own, not a module's: the GGUF name's
# `.weight` ending is dropped (`blk.N.attn_sinks.weight` -> `model.layers.N.self_attn.sinks`).
GGUF_BARE_TENSORS: frozenset[str] = frozenset({"attn_sinks"})

# GGUF tensors with no HF counterpart (derived from config in Loom).
GGUF_SKIPPED_TENSORS: frozenset[str] = frozenset({"rope_freqs.weight"})

# llama.cpp stores Gemma RMSNorm weights as w + 1; HF stores w.
GGUF_NORM_PLUS_ONE: frozenset[str] = frozenset({"gemma3"})

# llama.cpp permutes q/k rows of these architectures (interleaved rope); undo it.
GGUF_PERMUTED_QK: frozenset[str] = frozenset({"llama"})
