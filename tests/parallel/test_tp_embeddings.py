"""Embedding requests under tensor parallelism (two ranks over gloo on a CPU): the hidden
state is whole on every rank after each layer's all-reduce, so rank 0 pools it and nothing
more crosses processes; the embeddings equal the one-device ones."""

from __future__ import annotations

import torch
from engine.helpers import make_engine, prompt_ids, run_to_completion

from loom import SamplingParams
from loom.pooling_params import PoolingParams


def test_tp_embeddings_equal_one_device(tiny_models):
    folder, _ = tiny_models["qwen3"]
    one = make_engine(folder, max_num_batched_tokens=6)
    two = make_engine(folder, tensor_parallel_size=2, max_num_batched_tokens=6)
    try:
        for pooling in ("last", "mean"):
            for engine in (one, two):
                engine.add_request("g", prompt_ids(5), SamplingParams(max_tokens=3))
                engine.add_request("e", prompt_ids(17, 2), PoolingParams(pooling_type=pooling))
            got, want = (run_to_completion(e)["e"].outputs.embedding for e in (two, one))
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5,
                                       rtol=0)
        assert two.kv_pool_all_free
    finally:
        two.shutdown()
