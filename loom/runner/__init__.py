"""The model runner: scheduled chunks -> tensors -> model -> logits."""

from loom.runner.loading import build_model
from loom.runner.model_runner import ModelOutput, ModelRunner, kv_cache_bytes_per_block

__all__ = ["ModelOutput", "ModelRunner", "build_model", "kv_cache_bytes_per_block"]
