"""The model runner: scheduled chunks -> tensors -> model -> logits."""

from loom.runner.loading import build_model
from loom.runner.model_runner import ModelRunner, kv_cache_bytes_per_block

__all__ = ["ModelRunner", "build_model", "kv_cache_bytes_per_block"]
