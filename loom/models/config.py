"""`ModelConfig`: the few facts about a model the engine needs, derived from an HF config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Architectures whose text model lives under `text_config` of a multimodal config.
_NESTED_TEXT_ARCHITECTURES = frozenset({"Gemma3ForConditionalGeneration"})

# Defaults that HF config classes apply when a key is absent from config.json.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma3ForCausalLM": {
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "head_dim": 256,
        "sliding_window": 4096,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window_pattern": 6,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "eos_token_id": 1,
    },
    "LlamaForCausalLM": {"rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "hidden_act": "silu"},
    "Qwen2ForCausalLM": {"rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "hidden_act": "silu"},
    "Qwen3ForCausalLM": {"rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "hidden_act": "silu"},
    # transformers' Qwen3MoeConfig and MixtralConfig defaults.
    "Qwen3MoeForCausalLM": {"rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "hidden_act": "silu",
                            "norm_topk_prob": False, "decoder_sparse_step": 1,
                            "num_experts_per_tok": 8},
    "MixtralForCausalLM": {"rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0,
                           "hidden_act": "silu", "num_experts_per_tok": 2},
    # transformers' OlmoeConfig.
    "OlmoeForCausalLM": {"rms_norm_eps": 1e-5, "rope_theta": 10_000.0, "hidden_act": "silu",
                         "norm_topk_prob": False, "num_experts_per_tok": 8,
                         "num_experts": 64, "clip_qkv": None},
    # transformers' GptOssConfig.
    "GptOssForCausalLM": {"rms_norm_eps": 1e-5, "head_dim": 64, "sliding_window": 128,
                          "attention_bias": True, "tie_word_embeddings": False,
                          "num_experts_per_tok": 4, "swiglu_alpha": 1.702,
                          "swiglu_limit": 7.0, "max_position_embeddings": 131072},
}
_ARCH_DEFAULTS["Gemma3ForConditionalGeneration"] = _ARCH_DEFAULTS["Gemma3ForCausalLM"]


def _gpt_oss_defaults(flat: dict[str, Any]) -> None:
    """GptOssConfig's defaults that depend on other keys: layers alternate sliding (even
    indices) and full attention; with no rotary parameters at all, YaRN x32 over 4096."""
    if not flat.get("layer_types"):
        flat["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                               for i in range(int(flat["num_hidden_layers"]))]
    if not flat.get("rope_parameters") and not flat.get("rope_scaling"):
        flat["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": float(flat.get("rope_theta") or 150_000.0),
            "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 4096,
        }
    elif not flat.get("rope_parameters"):
        flat.setdefault("rope_theta", 150_000.0)  # the legacy layout's base, when absent


# Defaults computed from the config's other keys, per architecture (after `_ARCH_DEFAULTS`).
_DERIVED_DEFAULTS = {"GptOssForCausalLM": _gpt_oss_defaults}


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """Return the flat text-model config: `text_config` for multimodal models, defaults filled."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else ""
    flat = dict(hf.get("text_config") or {}) if arch in _NESTED_TEXT_ARCHITECTURES else dict(hf)
    if arch in _NESTED_TEXT_ARCHITECTURES:
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            if key not in flat and key in hf:
                flat[key] = hf[key]
    for key, value in _ARCH_DEFAULTS.get(arch, {}).items():
        flat.setdefault(key, value)
    if arch in _DERIVED_DEFAULTS:
        _DERIVED_DEFAULTS[arch](flat)
    return flat


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class ModelConfig:
    """Engine-facing model facts; `hf` keeps the raw config dict for the model builder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    hf: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def text(self) -> dict[str, Any]:
        """The flat text-model config (defaults filled)."""
        return text_config(self.hf)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Derive the engine-facing config from an HF config dict (config.json)."""
        archs = hf.get("architectures") or []
        if not archs:
            from loom.errors import UnsupportedModelError

            raise UnsupportedModelError("config has no 'architectures' entry")
        t = text_config(hf)
        num_heads = int(t["num_attention_heads"])
        head_dim = t.get("head_dim") or t["hidden_size"] // num_heads
        eos = _as_tuple(t.get("eos_token_id"))
        extra = _as_tuple((hf.get("generation_config") or {}).get("eos_token_id"))
        eos = eos + tuple(e for e in extra if e not in eos)
        layer_types = t.get("layer_types") or []
        uses_window = "sliding_attention" in layer_types or archs[0].startswith("Gemma3")
        if t.get("use_sliding_window") is False:
            uses_window = False
        window = t.get("sliding_window") if uses_window else None
        return cls(
            architecture=archs[0],
            vocab_size=int(t["vocab_size"]),
            hidden_size=int(t["hidden_size"]),
            num_layers=int(t["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(t.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(t.get("max_position_embeddings") or 2048),
            sliding_window=int(window) if window else None,
            eos_token_ids=eos,
            hf=hf,
        )
