"""The prepared-weights cache on the real Gemma 3 270M: a warm start equals a cold one tensor
for tensor, the embedding table stays exact as int8 blocks, damaged entries are rebuilt."""

from __future__ import annotations

import pytest
import torch

from loom.models.block_embedding import BlockInt8Embedding
from loom.runner import build_model, loading
from loom.runner.prepared import wait_for_prepared_writes


def _state(model) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LOOM_PREPARED_CACHE", raising=False)
    return tmp_path / "prepared"


def test_warm_start_equals_cold_and_damage_is_rebuilt(gemma_path, gemma_engine, cache_dir,
                                                       monkeypatch):
    _, cold = build_model(gemma_path, torch.float32, quantization="w8a8")
    # The cold load wrote its entry on a thread; a second load in this process waits for it
    # and reads it (it never opens the GGUF file again).
    with monkeypatch.context() as patch:
        def no_source(*args, **kwargs):
            raise AssertionError("the warm load parsed the GGUF file")

        patch.setattr(loading, "load_model_files", no_source)
        _, warm = build_model(gemma_path, torch.float32, quantization="w8a8")
    entries = list(cache_dir.glob("*.safetensors"))
    assert len(entries) == 1
    entries_size = entries[0].stat().st_size
    cold_state, warm_state = _state(cold), _state(warm)
    assert cold_state.keys() == warm_state.keys()
    for name, tensor in cold_state.items():
        assert tensor.dtype == warm_state[name].dtype, name
        assert torch.equal(tensor, warm_state[name]), name
    # The Q8_0 token table is kept as int8 blocks (cold and warm), and its rows are exactly
    # the dense float32 table's (the float engine's, loaded without quantization).
    dense = gemma_engine.runner.model.model.embed_tokens.weight
    for model in (cold, warm):
        embedding = model.model.embed_tokens
        assert isinstance(embedding, BlockInt8Embedding)
        ids = torch.arange(dense.shape[0])
        for chunk in ids.split(65536):
            assert torch.equal(embedding(chunk), dense[chunk])
    # A truncated entry is discarded and the model prepared again from the GGUF file.
    entry = entries[0]
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    _, again = build_model(gemma_path, torch.float32, quantization="w8a8")
    assert isinstance(again.model.embed_tokens, BlockInt8Embedding)
    assert torch.equal(again.lm_head.weight_q, cold.lm_head.weight_q)
    wait_for_prepared_writes()
    rebuilt = list(cache_dir.glob("*.safetensors"))
    assert len(rebuilt) == 1 and rebuilt[0].stat().st_size == entries_size


def test_switching_the_cache_off_writes_nothing(gemma_path, cache_dir, monkeypatch):
    monkeypatch.setenv("LOOM_PREPARED_CACHE", "0")
    build_model(gemma_path, torch.float32, quantization="int8")
    wait_for_prepared_writes()
    assert not cache_dir.exists() or not list(cache_dir.glob("*.safetensors"))
