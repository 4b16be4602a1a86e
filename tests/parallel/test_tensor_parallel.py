"""Tensor parallelism on a CPU: two ranks over gloo give the one-device results.

One tensor-parallel engine lives at a time (torch.distributed has one default group per
process): each fixture shuts its engine down before the next one starts, and ranks start once
per fixture, not per test.
"""

from __future__ import annotations

import pytest
import torch
from engine.helpers import (
    make_engine,
    prompt_ids,
    run_to_completion,
    session_logits,
    settle_session,
)
from tiny_reference import TINY_ARCHS, hf_greedy, hf_last_logits

from loom import SamplingParams

ATOL = 1e-5  # float32 TP=2 against TP=1 (a sum split in two, then added: rounding only)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


# OLMoE does not split over ranks yet (test_tensor_parallel_features checks the refusal).
@pytest.fixture(scope="module", params=[arch for arch in TINY_ARCHS if arch != "olmoe"])
def pair(request, tiny_models):
    """(TP=1 engine, TP=2 engine, transformers model) of one tiny architecture."""
    folder, hf = tiny_models[request.param]
    one = make_engine(folder)
    two = make_engine(folder, tensor_parallel_size=2)
    yield one, two, hf
    two.shutdown()
    assert all(w.poll() is not None for w in two.executor.workers)


def test_logits_equal_one_device_and_tokens_equal_transformers(pair):
    one, two, hf = pair
    assert two.config.tensor_parallel_size == 2 and "tensor parallel 2" in two.config.mode_summary
    for n in (3, 17):
        tokens = prompt_ids(n, offset=n)
        got = session_logits(two, f"l{n}", tokens)
        torch.testing.assert_close(got, session_logits(one, f"l{n}", tokens), atol=ATOL, rtol=0)
        torch.testing.assert_close(got, hf_last_logits(hf, tokens), atol=1e-4, rtol=0)
    prompt = prompt_ids(7)
    two.add_request("g", prompt, GREEDY)
    out = run_to_completion(two)["g"]
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 8)
    assert two.kv_pool_all_free


def test_a_live_session_equals_a_fresh_forward(pair):
    """Prefill, generate, append, generate, append: the stored logits equal one forward pass
    over the session's tokens on TP=2, on TP=1 and in transformers."""
    one, two, hf = pair
    two.add_request("s", prompt_ids(6), session=True)
    settle_session(two, "s")
    for fragment in (prompt_ids(5, offset=40), prompt_ids(9, offset=80)):
        two.resume("s", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        settle_session(two, "s")
        two.append("s", fragment)
        settle_session(two, "s")
    tokens = list(two.get_session("s").token_ids)
    assert len(tokens) == 6 + 4 + 5 + 4 + 9
    stored = two.get_logits("s")
    torch.testing.assert_close(stored, session_logits(two, "fresh", tokens), atol=ATOL, rtol=0)
    torch.testing.assert_close(stored, session_logits(one, "fresh", tokens), atol=ATOL, rtol=0)
    torch.testing.assert_close(stored, hf_last_logits(hf, tokens), atol=1e-4, rtol=0)
    two.close("s")
    assert two.kv_pool_all_free


def test_prefix_cache_hit_and_seeded_forks(pair):
    """n=3 seeded samples (forked sequences sharing the prompt's KV, copy-on-write) and a
    second request hitting the prefix cache give TP=1's tokens and logprobs."""
    one, two, _ = pair
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=2,
                             ignore_eos=True)
    prompt = prompt_ids(13, offset=3)
    results = []
    for engine in (one, two):
        hits = engine.stats.prefix_cache_hits
        engine.add_request("a", prompt, sampled)
        first = run_to_completion(engine)["a"]
        engine.add_request("b", prompt, sampled)
        second = run_to_completion(engine)["b"]
        assert engine.stats.prefix_cache_hits > hits
        results.append([first, second])
    for a, b in zip(results[0], results[1], strict=True):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert ca.token_ids == cb.token_ids
            for la, lb in zip(ca.logprobs, cb.logprobs, strict=True):
                assert la.keys() == lb.keys()
                assert all(abs(la[k] - lb[k]) < 1e-4 for k in la)
