"""Model architectures built from shared layers; they read attention state from the context."""

from loom.models.base import CausalLM
from loom.models.config import ModelConfig
from loom.models.registry import get_model_class, supported_architectures

__all__ = ["CausalLM", "ModelConfig", "get_model_class", "supported_architectures"]
