"""Tiny random-weight HF models (all supported architectures) and chunk-plan helpers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loom.core.scheduler_output import ScheduledChunk
from loom.runner import ModelRunner, build_model

__all__ = [
    "PARITY_ATOL", "TINY_BUILDERS", "TinyModel", "blocks_for", "chunk", "load_tiny", "save_tiny",
]

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 320,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}
# Loom vs transformers float32 logits (test_hf_parity, test_fused_decode_matches_transformers).
PARITY_ATOL = 1e-4
QK_PROJ_GAIN = 8.0  # q/k weights of std 0.16: attention scores of order 1 (see save_tiny)


def _gemma3() -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **_COMMON, num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        rope_theta=10_000.0, rope_local_base_freq=100.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        final_logit_softcapping=30.0,  # (HF Gemma 3 ignores attn_logit_softcapping)
    )
    return Gemma3ForCausalLM(config)


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **_COMMON, num_hidden_layers=2, rope_theta=500_000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )
    return LlamaForCausalLM(config)


def _qwen2() -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**_COMMON, num_hidden_layers=2, tie_word_embeddings=True))


def _qwen3() -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**_COMMON, num_hidden_layers=2))


def _olmoe() -> Any:
    """OLMoE: QK-norm over all heads at once, 8 experts of width 32, 2 a token."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    return OlmoeForCausalLM(OlmoeConfig(**{**_COMMON, "intermediate_size": 32},
                                        num_hidden_layers=2, num_experts=8,
                                        num_experts_per_tok=2, norm_topk_prob=False))


TINY_BUILDERS: dict[str, Callable[[], Any]] = {
    "gemma3": _gemma3,
    "llama": _llama,
    "olmoe": _olmoe,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
}
# A mixture of experts' router weights are scaled by this: at the init's std of 0.02 every
# expert's probability is nearly equal and the choice would turn on rounding.
ROUTER_GAIN = 50.0


@dataclass
class TinyModel:
    """A saved tiny HF model, its transformers reference and the Loom build of it."""

    name: str
    path: Path
    hf_model: Any
    loom_config: Any
    loom_model: Any

    def reference_logits(self, token_ids: list[int]) -> torch.Tensor:
        """transformers' float32 logits [T, V] for one sequence."""
        with torch.no_grad():
            out = self.hf_model(torch.tensor([token_ids]))
        return out.logits[0].float()

    def runner(self, num_blocks: int = 64, block_size: int = 4) -> ModelRunner:
        """A fresh runner (empty KV cache) over the Loom model."""
        return ModelRunner(
            self.loom_config, self.loom_model, "cpu", torch.float32, num_blocks, block_size
        )


def save_tiny(name: str, folder: Path, **save_kwargs: Any) -> Any:
    """Build tiny HF model `name` (seeded) and save it under `folder`; returns it (eval)."""
    torch.manual_seed(0)
    model = TINY_BUILDERS[name]().eval()
    model.set_attn_implementation("eager")  # eager honours attention logit softcapping
    # Norm weights spread around the identity (Gemma scales by 1 + w, the others by w), and
    # q/k projections large enough that attention is far from uniform (Gemma and Qwen3
    # normalise q and k): logits depend on token order, so a RoPE or position bug moves them
    # far past the parity tolerance (tests/models/test_position_sensitivity.py).
    identity = 0.0 if name == "gemma3" else 1.0
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(identity, 0.3)
            elif name in ("llama", "qwen2") and pname.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(QK_PROJ_GAIN)
            elif pname.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_GAIN)
    model.save_pretrained(folder, **save_kwargs)
    return model


def blocks_for(seq: int, num_positions: int, block_size: int, per_seq: int = 16) -> list[int]:
    """Disjoint, deliberately non-contiguous block ids for sequence `seq`."""
    needed = -(-num_positions // block_size)
    # Interleave sequences' blocks and reverse the order so block tables are not trivial.
    return [(per_seq - 1 - j) * 4 + seq for j in range(needed)]


def chunk(
    rid: str, tokens: list[int], start: int, total: int, seq: int, block_size: int = 4,
    needs_logits: bool = True,
) -> ScheduledChunk:
    """A chunk of `tokens` at `start` for a sequence that will reach `total` positions."""
    return ScheduledChunk(
        request_id=rid, token_ids=tokens, start_pos=start,
        block_ids=blocks_for(seq, total, block_size), needs_logits=needs_logits,
    )


def load_tiny(name: str, folder: Path) -> TinyModel:
    """Save tiny model `name` under `folder` and build Loom's model from the folder."""
    hf_model = save_tiny(name, folder)
    config, model = build_model(folder, dtype=torch.float32)
    return TinyModel(name, folder, hf_model, config, model)
