"""Embeddings of the real default model (Gemma 3 270M, exact float32 mode) equal transformers'
pooled final hidden states (after the final norm), last and mean, normalised and not."""

from __future__ import annotations

import pytest
import torch
from engine.helpers import run_to_completion

from loom.pooling_params import PoolingParams

PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def engine(gemma_engine):
    yield gemma_engine
    assert gemma_engine.kv_pool_all_free


def test_gemma_embeddings_equal_transformers(engine, gemma_hf):
    ids = engine.tokenizer.encode(PROMPT)
    with torch.no_grad():
        hidden = gemma_hf.model(torch.tensor([ids])).last_hidden_state[0].double()
    for pooling in ("last", "mean"):
        for normalize in (True, False):
            rid = f"emb-{pooling}-{normalize}"
            engine.add_request(rid, PROMPT, PoolingParams(pooling_type=pooling,
                                                          normalize=normalize))
            out = run_to_completion(engine)[rid]
            assert out.prompt_token_ids == ids
            got = torch.tensor(out.outputs.embedding, dtype=torch.float64)
            ref = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
            if normalize:
                ref = ref / ref.norm()
            assert got.shape == ref.shape
            # float32 through 18 layers: equal to a small share of the vector's size.
            scale = ref.abs().max().item()
            torch.testing.assert_close(got, ref, atol=1e-5 * scale, rtol=0,
                                       msg=f"{pooling}, normalize={normalize}")
            assert torch.nn.functional.cosine_similarity(got, ref, dim=0) > 1 - 1e-6
