"""OLMoE: the Llama block with a QK-norm spanning all heads and a mixture of experts (softmax
over every expert, top-k, not renormalised unless the config says so) in every layer."""

from __future__ import annotations

from typing import Any

from torch import nn

from loom.errors import UnsupportedModelError
from loom.models.config import ModelConfig
from loom.models.llama import LlamaForCausalLM
from loom.models.moe import SparseMoE, expert_count


class OlmoeForCausalLM(LlamaForCausalLM):
    """OLMoE-1B-7B and its kind (`olmoe` GGUFs)."""

    qk_norm = True
    qk_norm_all_heads = True

    def __init__(self, config: ModelConfig) -> None:
        clip = config.text.get("clip_qkv")
        if clip is not None:
            raise UnsupportedModelError(
                f"OLMoE with clip_qkv={clip} (q, k and v clamped) is not supported; the"
                " released OLMoE models set none")
        super().__init__(config)

    @classmethod
    def feed_forward(cls, layer_idx: int, t: dict[str, Any],
                     config: ModelConfig) -> nn.Module | None:
        return SparseMoE(config.hidden_size, int(t["intermediate_size"]), expert_count(t),
                         int(t["num_experts_per_tok"]), bool(t.get("norm_topk_prob")),
                         t["hidden_act"])
