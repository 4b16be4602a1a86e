"""Qwen3: the Llama block with per-head RMS QK-norm and no QKV bias."""

from __future__ import annotations

from loom.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models."""

    qk_norm = True
