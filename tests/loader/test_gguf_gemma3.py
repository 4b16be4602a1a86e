"""The GGUF loader on the real Gemma 3 270M file, checked against transformers' GGUF load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from loom.core.scheduler_output import ScheduledChunk
from loom.loader.gguf_file import gguf_to_hf_config, gguf_to_hf_name
from loom.loader.gguf_reader import GGUFFile
from loom.models import ModelConfig
from loom.runner import ModelRunner

# Token ids of a short Gemma prompt ("<bos>The capital of France is" and some more ids).
PROMPT = [2, 818, 5279, 529, 7001, 563, 236743, 108, 4010, 17977, 496, 1607, 236761]


@pytest.fixture(scope="session")
def gguf_path(gemma_path: Path) -> Path:
    """The assembled Gemma 3 270M Q4_K_M file (the session's shared fixture)."""
    return gemma_path


@pytest.fixture(scope="session")
def hf_gguf_model(gemma_hf: Any) -> Any:
    """transformers' own GGUF load of the same file (float32), shared with other tests."""
    return gemma_hf


@pytest.fixture(scope="session")
def loom_gguf_model(gemma_engine: Any) -> tuple[ModelConfig, Any]:
    """Loom's float32 build of the file, the one inside the shared engine fixture."""
    return gemma_engine.runner.model_config, gemma_engine.runner.model


def test_config_matches_transformers(
    loom_gguf_model: tuple[ModelConfig, Any], hf_gguf_model: Any
) -> None:
    """Layer pattern, rope bases, attention scale and shapes agree with transformers' config."""
    config, model = loom_gguf_model
    ref = hf_gguf_model.config
    assert config.architecture == "Gemma3ForCausalLM"
    assert (config.num_layers, config.hidden_size) == (ref.num_hidden_layers, ref.hidden_size)
    assert config.num_heads == ref.num_attention_heads
    assert config.num_kv_heads == ref.num_key_value_heads
    assert config.head_dim == ref.head_dim and config.vocab_size == ref.vocab_size
    assert config.sliding_window == ref.sliding_window
    windows = [layer.self_attn.attn.spec.sliding_window for layer in model.model.layers]
    assert [w is not None for w in windows] == [t == "sliding_attention" for t in ref.layer_types]
    scale = model.model.layers[0].self_attn.attn.spec.scale
    assert scale == pytest.approx(ref.query_pre_attn_scalar**-0.5)
    assert 1 in config.eos_token_ids


def test_logits_match_transformers(
    loom_gguf_model: tuple[ModelConfig, Any], hf_gguf_model: Any
) -> None:
    """Prefill + decode logits of the prompt agree with transformers to 1e-3 (float32)."""
    config, model = loom_gguf_model
    with torch.no_grad():
        ref = hf_gguf_model(torch.tensor([PROMPT])).logits[0].float()
    runner = ModelRunner(config, model, "cpu", torch.float32, num_blocks=8, block_size=4)
    blocks = [5, 2, 7, 0]
    n = len(PROMPT)
    first = runner.execute([ScheduledChunk("g", PROMPT[:-2], 0, blocks, True)])
    torch.testing.assert_close(first[0], ref[n - 3], atol=1e-3, rtol=0)
    for pos in (n - 2, n - 1):
        out = runner.execute([ScheduledChunk("g", [PROMPT[pos]], pos, blocks, True)])
        torch.testing.assert_close(out[0], ref[pos], atol=1e-3, rtol=0)
    assert int(out[0].argmax()) == int(ref[-1].argmax())


def test_weight_names_are_hf_names(
    gguf_path: Path, loom_gguf_model: tuple[ModelConfig, Any]
) -> None:
    """Every GGUF tensor maps onto a Loom parameter; tied embeddings have no lm_head."""
    config, loaded = loom_gguf_model
    reader = GGUFFile(gguf_path)
    hf_config = gguf_to_hf_config(reader)
    assert hf_config["tie_word_embeddings"] is True
    names = {gguf_to_hf_name("gemma3", t.name) for t in reader.tensors}
    # Names are those of the model as constructed (before q/k/v and gate/up are stacked).
    with torch.device("meta"):
        model = type(loaded)(config)
    assert names == set(dict(model.named_parameters()))
