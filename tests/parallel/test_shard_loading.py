"""A rank reads only its part of each tensor: safetensors slices and GGUF rows equal the
whole tensor cut afterwards, padding included."""

from __future__ import annotations

import pytest
import torch

from loom.loader import load_model_files
from loom.models.weight_shard import ShardRule


def _rules(names_rows, names_cols, padded):
    rules = {}
    for name, size in names_rows:
        rules[name] = ShardRule(0, size // 2, size)  # rank 1's rows
    for name, size in names_cols:
        rules[name] = ShardRule(1, 0, size // 2)  # rank 0's columns
    name, size = padded
    rules[name] = ShardRule(0, size // 2, size // 2 + size // 2 + 3)  # 3 padding rows
    return rules


def _check(path, rules):
    whole = load_model_files(path).weights
    parts = load_model_files(path, select=rules.get).weights
    seen = 0
    for (name, full), (name2, part) in zip(whole, parts, strict=True):
        assert name == name2
        if name in rules:
            torch.testing.assert_close(part, rules[name].apply(full), atol=0, rtol=0)
            seen += 1
        else:
            assert torch.equal(part, full)
    assert seen == len(rules)


def test_safetensors_slices_equal_the_cut_tensors(tiny_models):
    folder, _ = tiny_models["qwen2"]  # q/k/v biases: 1-D parts
    layer = "model.layers.0"
    _check(folder, _rules(
        [(f"{layer}.self_attn.q_proj.weight", 64), (f"{layer}.self_attn.q_proj.bias", 64),
         (f"{layer}.mlp.gate_proj.weight", 128)],
        [(f"{layer}.self_attn.o_proj.weight", 64), (f"{layer}.mlp.down_proj.weight", 128)],
        ("model.embed_tokens.weight", 512)))


@pytest.mark.slow
def test_gguf_rows_equal_the_cut_tensors(gemma_path):
    """Gemma's quantised q_proj and gate_proj rows dequantised alone equal the whole tensors'
    rows; columns (o_proj) are cut after dequantising."""
    layer = "model.layers.3"
    _check(gemma_path, _rules(
        [(f"{layer}.self_attn.q_proj.weight", 1024), (f"{layer}.mlp.gate_proj.weight", 2048)],
        [(f"{layer}.self_attn.o_proj.weight", 1024)],
        ("model.embed_tokens.weight", 262144)))
