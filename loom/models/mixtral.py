"""Mixtral: the Llama block with a mixture of experts (top-k, then softmax over them) in
place of the dense MLP."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from loom.models.config import ModelConfig
from loom.models.llama import LlamaForCausalLM
from loom.models.moe import SparseMoE, expert_count

# Mixtral's checkpoint names -> the shared block's (w1 gates, w3 is up, w2 is down).
_MIXTRAL_NAMES = (
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."),
    (re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate."),
)


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral 8x7B / 8x22B (and Llama-architecture GGUFs with expert tensors)."""

    @classmethod
    def feed_forward(cls, layer_idx: int, t: dict[str, Any],
                     config: ModelConfig) -> nn.Module | None:
        # Softmax over the top-k logits equals the renormalised top-k of the full softmax.
        return SparseMoE(config.hidden_size, int(t["intermediate_size"]),
                         expert_count(t), int(t["num_experts_per_tok"]), True,
                         t["hidden_act"])

    def map_weight_name(self, name: str) -> str | None:
        for pattern, replacement in _MIXTRAL_NAMES:
            name = pattern.sub(replacement, name)
        return super().map_weight_name(name)
