"""gpt-oss: the Llama block with attention sinks, biases on every projection, sliding and
full attention layers in turn, YaRN rotary scaling and a mixture of experts (a router with a
bias, top-k of the logits then a softmax over those k, experts with biases gated by the
clamped SwiGLU)."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from loom.errors import UnsupportedModelError
from loom.models.config import ModelConfig
from loom.models.expert_tensors import FusedExpertTensor
from loom.models.layers import ClampedSwiGLU
from loom.models.llama import LlamaForCausalLM
from loom.models.moe import SparseMoE, expert_count

# HF's experts: one 3-D tensor per projection, each expert's matrix stored [in, out], gate
# and up interleaved along the output (gate = columns 0, 2, 4, ..., up = 1, 3, 5, ...).
_EXPERT_TENSORS = (
    FusedExpertTensor("experts.gate_up_proj", ("gate_proj.weight", "up_proj.weight"),
                      transposed=True),
    FusedExpertTensor("experts.gate_up_proj_bias", ("gate_proj.bias", "up_proj.bias")),
    FusedExpertTensor("experts.down_proj", ("down_proj.weight",), transposed=True),
    FusedExpertTensor("experts.down_proj_bias", ("down_proj.bias",)),
)

# gpt-oss's checkpoint names -> the shared block's (its router is the block's gate).
_GPT_OSS_NAMES = ((re.compile(r"\.mlp\.router\."), ".mlp.gate."),)


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss-20b / gpt-oss-120b in float form (HF folders with bf16 or float32 experts)."""

    attention_sinks = True
    fused_expert_tensors = _EXPERT_TENSORS

    def __init__(self, config: ModelConfig) -> None:
        method = (config.text.get("quantization_config") or {}).get("quant_method")
        if method is not None:
            raise UnsupportedModelError(
                f"gpt-oss checkpoints quantised as {method!r} are not supported; use one with"
                " float (bf16) expert weights")
        super().__init__(config)

    @classmethod
    def feed_forward(cls, layer_idx: int, t: dict[str, Any],
                     config: ModelConfig) -> nn.Module | None:
        activation = ClampedSwiGLU(float(t["swiglu_alpha"]), float(t["swiglu_limit"]))
        return SparseMoE(config.hidden_size, int(t["intermediate_size"]), expert_count(t),
                         int(t["num_experts_per_tok"]), True, activation,
                         scoring="topk_softmax", router_bias=True, expert_bias=True)

    def map_weight_name(self, name: str) -> str | None:
        for pattern, replacement in _GPT_OSS_NAMES:
            name = pattern.sub(replacement, name)
        return super().map_weight_name(name)
