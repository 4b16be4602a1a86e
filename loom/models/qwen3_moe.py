"""Qwen3-MoE: the Qwen3 block with a mixture of experts in place of the dense MLP."""

from __future__ import annotations

from typing import Any

from torch import nn

from loom.models.config import ModelConfig
from loom.models.moe import SparseMoE, expert_count
from loom.models.qwen3 import Qwen3ForCausalLM


def qwen3_moe_block(layer_idx: int, t: dict[str, Any], config: ModelConfig) -> SparseMoE | None:
    """The experts of layer `layer_idx`, or None where the layer is dense (`mlp_only_layers`,
    or off the `decoder_sparse_step`), as transformers decides."""
    experts = expert_count(t)
    step = int(t.get("decoder_sparse_step") or 1)
    if layer_idx in (t.get("mlp_only_layers") or []) or experts == 0 or (layer_idx + 1) % step:
        return None
    return SparseMoE(config.hidden_size, int(t["moe_intermediate_size"]), experts,
                     int(t["num_experts_per_tok"]), bool(t.get("norm_topk_prob")),
                     t["hidden_act"])


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-30B-A3B, Qwen3-235B-A22B and their kind."""

    @classmethod
    def feed_forward(cls, layer_idx: int, t: dict[str, Any],
                     config: ModelConfig) -> nn.Module | None:
        return qwen3_moe_block(layer_idx, t, config)
