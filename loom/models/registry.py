"""HF `architectures` name -> Loom model class."""

from __future__ import annotations

from loom.errors import UnsupportedModelError
from loom.models.base import CausalLM
from loom.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from loom.models.gpt_oss import GptOssForCausalLM
from loom.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from loom.models.mixtral import MixtralForCausalLM
from loom.models.olmoe import OlmoeForCausalLM
from loom.models.qwen3 import Qwen3ForCausalLM
from loom.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def supported_architectures() -> list[str]:
    """Names of the HF architectures Loom can run."""
    return sorted(MODEL_REGISTRY)


def get_model_class(architecture: str) -> type[CausalLM]:
    """Return the model class for an HF architecture name."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        ) from None
