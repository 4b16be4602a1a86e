"""Embedding requests (`PoolingParams`, `LLM.embed`): the pooled final hidden state equals
transformers' (exact float mode), and the same prompt's embedding is the same bits alone,
batched with generation, chunked, and from the prefix cache, in the default mode too; an
embedding request frees its blocks when it ends."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine.helpers import make_engine, prompt_ids, run_to_completion

from loom import SamplingParams
from loom.engine.pooling import EmbeddingRequestOutput, allowed_dimensions
from loom.errors import InvalidRequestError
from loom.pooling_params import PoolingParams

ATOL = 1e-4  # as the parity tests (tests/models/tiny_models.PARITY_ATOL)


def _reference(hf_model, ids: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    """transformers' final hidden states (after the final norm), pooled."""
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0].double()
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    if normalize:
        vector = vector / vector.norm()
    return vector.float()


def _embed(engine, ids, params: PoolingParams, rid: str = "e") -> list[float]:
    engine.add_request(rid, ids, params)
    out = run_to_completion(engine)[rid]
    assert isinstance(out, EmbeddingRequestOutput) and out.finished and out.error is None
    assert out.prompt_token_ids == list(ids)
    return out.outputs.embedding


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_embedding_matches_transformers(tiny_models, pooling, normalize) -> None:
    folder, hf_model = tiny_models["qwen3"]
    engine = make_engine(folder, quantization=None, max_num_batched_tokens=7)  # chunked
    ids = prompt_ids(19)
    got = _embed(engine, ids, PoolingParams(pooling_type=pooling, normalize=normalize))
    ref = _reference(hf_model, ids, pooling, normalize)
    assert len(got) == hf_model.config.hidden_size
    torch.testing.assert_close(torch.tensor(got), ref, atol=ATOL, rtol=0)
    if normalize:
        assert abs(torch.tensor(got, dtype=torch.float64).norm().item() - 1) < 1e-6
    assert engine.kv_pool_all_free


def test_default_pooling_is_last_token_normalised(tiny_models) -> None:
    folder, hf_model = tiny_models["qwen3"]
    engine = make_engine(folder, quantization=None)
    ids = prompt_ids(11, 3)
    got = _embed(engine, ids, PoolingParams())
    torch.testing.assert_close(torch.tensor(got), _reference(hf_model, ids, "last", True),
                               atol=ATOL, rtol=0)


def _same(got: list[float], want: list[float], quantization: str | None) -> None:
    """Bit for bit in the default mode (w8a8); float32 mode's products depend on the rows in
    the call, so there only close."""
    if quantization == "w8a8":
        assert got == want
    else:
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)


@pytest.mark.parametrize("quantization", [None, "w8a8"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_same_bits_alone_batched_chunked_and_cached(tiny_models, quantization,
                                                    pooling) -> None:
    folder, _ = tiny_models["qwen3"]
    ids = prompt_ids(41, 5)
    params = PoolingParams(pooling_type=pooling)
    alone = _embed(make_engine(folder, quantization=quantization), ids, params)
    # Batched with generation requests (one started before, one beside), chunked by 5.
    engine = make_engine(folder, quantization=quantization, max_num_batched_tokens=5)
    engine.add_request("g1", prompt_ids(13, 1), SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()
    engine.add_request("g2", prompt_ids(7, 2), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("e", ids, params)
    outs = run_to_completion(engine)
    _same(outs["e"].outputs.embedding, alone, quantization)
    assert len(outs["g1"].outputs[0].token_ids) == 6 and len(outs["g2"].outputs[0].token_ids) == 4
    # Again on the same engine: its prompt's blocks are in the prefix cache ("last" may
    # take them; "mean" computes every row).
    _same(_embed(engine, ids, params, "again"), alone, quantization)
    assert engine.kv_pool_all_free


def test_embedding_request_takes_prefix_cache_hits_only_for_last(tiny_models) -> None:
    folder, _ = tiny_models["qwen3"]
    ids = prompt_ids(24, 6)
    for pooling, hits in (("last", True), ("mean", False)):
        engine = make_engine(folder)
        engine.add_request("g", ids, SamplingParams(max_tokens=1))
        run_to_completion(engine)
        engine.add_request("e", ids, PoolingParams(pooling_type=pooling))
        engine.step()
        chunk = engine.last_scheduler_output.chunks[0]
        assert (chunk.start_pos > 0) is hits and chunk.pooling == pooling
        assert not chunk.needs_logits and chunk.num_logits == 0
        run_to_completion(engine)
        assert engine.kv_pool_all_free


def test_dimensions_needs_a_matryoshka_model_and_bad_params_are_refused(tiny_models) -> None:
    folder, _ = tiny_models["qwen3"]
    engine = make_engine(folder)
    with pytest.raises(InvalidRequestError, match="dimensions"):
        engine.add_request("d", prompt_ids(5), PoolingParams(dimensions=8))
    with pytest.raises(InvalidRequestError, match="pooling_type"):
        PoolingParams(pooling_type="cls")
    with pytest.raises(InvalidRequestError, match="dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(InvalidRequestError, match="session"):
        engine.add_request("s", prompt_ids(5), PoolingParams(), session=True)
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request("v", [10**6], PoolingParams())
    assert not engine.is_live("d") and engine.kv_pool_all_free


def test_allowed_dimensions_follow_the_model_config() -> None:
    assert allowed_dimensions(8, {}) == []
    assert allowed_dimensions(8, {"is_matryoshka": True}) == list(range(1, 9))
    assert allowed_dimensions(8, {"matryoshka_dimensions": [16, 4, 2]}) == [2, 4]


def test_dimensions_on_a_matryoshka_model(tiny_models) -> None:
    folder, hf_model = tiny_models["qwen3"]
    engine = make_engine(folder, quantization=None)
    hidden = hf_model.config.hidden_size
    # What a matryoshka model's config says (`is_matryoshka: true`), as resolve derives it.
    engine.config = replace(engine.config, embedding_dimensions=tuple(
        allowed_dimensions(hidden, {"is_matryoshka": True})))
    ids = prompt_ids(9, 7)
    got = _embed(engine, ids, PoolingParams(dimensions=8))
    full = _reference(hf_model, ids, "last", False)[:8].double()
    torch.testing.assert_close(torch.tensor(got), (full / full.norm()).float(), atol=ATOL,
                               rtol=0)
    with pytest.raises(InvalidRequestError, match=f"at most {hidden}"):
        engine.add_request("big", ids, PoolingParams(dimensions=hidden + 1))
    engine.config = replace(engine.config, embedding_dimensions=(4, 16))
    with pytest.raises(InvalidRequestError, match=r"one of \[4, 16\]"):
        engine.add_request("odd", ids, PoolingParams(dimensions=8))
    assert len(_embed(engine, ids, PoolingParams(dimensions=4), "four")) == 4
    assert engine.kv_pool_all_free


def test_abort_and_preemption_free_everything(tiny_models) -> None:
    folder, _ = tiny_models["qwen3"]
    ids = prompt_ids(40, 8)
    params = PoolingParams(pooling_type="mean")
    alone = _embed(make_engine(folder, quantization="w8a8"), ids, params)
    engine = make_engine(folder, max_num_batched_tokens=4)
    engine.add_request("x", ids, params)
    engine.step()
    engine.abort_request("x")
    assert engine.kv_pool_all_free and "x" not in engine.core.pooler
    # A pool too small for both: one is preempted and recomputed; same bits.
    engine = make_engine(folder, quantization="w8a8", num_kv_blocks=16,
                         max_num_batched_tokens=8)
    engine.add_request("g", prompt_ids(20, 9), SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("e", ids, params)
    outs, preempted = {}, set()
    while engine.has_unfinished_requests():
        outs.update((out.request_id, out) for out in engine.step())
        preempted.update(engine.last_scheduler_output.preempted_request_ids)
    assert "e" in preempted
    assert outs["e"].outputs.embedding == alone
    assert engine.kv_pool_all_free


def test_llm_embed(tiny_models) -> None:
    from loom import LLM

    folder, _ = tiny_models["qwen3"]
    llm = LLM(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=64,
              block_size=4, max_model_len=64)
    outs = llm.embed([prompt_ids(6), {"prompt_token_ids": prompt_ids(8, 1)}, "hello world"],
                     PoolingParams(pooling_type="mean"))
    hidden = llm.engine.runner.model_config.hidden_size
    assert [len(o.outputs.embedding) for o in outs] == [hidden] * 3
    assert outs[1].prompt_token_ids == prompt_ids(8, 1)
    again = llm.embed(prompt_ids(6), PoolingParams(pooling_type="mean"))
    assert again[0].outputs.embedding == outs[0].outputs.embedding
    too_long = llm.embed([prompt_ids(65)])[0]
    assert too_long.error and "max_model_len" in too_long.error
    assert too_long.outputs.embedding == []
    assert llm.engine.kv_pool_all_free
