"""Prefix caching on tiny models: cache hits change what is computed, never the output.

Every test checks the mission's invariant on top: logits after a hit equal a fresh forward
pass (transformers) over the same tokens, and closing everything leaves the pool free.
"""

from __future__ import annotations

import pytest
import torch
from engine.helpers import make_engine, prompt_ids, run_to_completion
from tiny_reference import TINY_ARCHS, hf_greedy, hf_last_logits

from loom import SamplingParams

ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PREFIX = prompt_ids(37, 1)  # 9 full blocks of 4 and one token


def session_logits(engine, rid, ids):
    """Open a prefill-only session on `ids`, run it; its stored logits."""
    engine.add_request(rid, ids, session=True)
    run_to_completion(engine)
    return engine.get_logits(rid)



@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_requests_sharing_a_prefix_hit_the_cache_and_equal_transformers(tiny_models, arch):
    folder, hf = tiny_models[arch]
    engine = make_engine(folder, max_num_batched_tokens=64)
    prompts = [PREFIX + prompt_ids(5 + i, 20 + i) for i in range(3)]
    engine.add_request("0", prompts[0], GREEDY)
    outs = run_to_completion(engine)
    starts = []
    for i in (1, 2):
        engine.add_request(str(i), prompts[i], GREEDY)
        engine.step()
        starts.append(engine.last_scheduler_output.chunks[0].start_pos)
        outs.update(run_to_completion(engine))
    assert starts == [36, 36]  # the 9 cached blocks of the shared prefix were not computed
    for i, ids in enumerate(prompts):
        assert outs[str(i)].outputs[0].token_ids == hf_greedy(hf, ids, 8)
    stats = engine.stats
    assert stats.prefix_cache_hits == 72 and 0 < stats.prefix_cache_hit_rate < 1
    assert engine.kv_pool_all_free and stats.num_cached_kv_blocks > 0


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_logits_after_a_hit_equal_a_fresh_forward(tiny_models, arch):
    folder, hf = tiny_models[arch]
    engine = make_engine(folder)
    ids = PREFIX + prompt_ids(6, 30)
    session_logits(engine, "warm", PREFIX + prompt_ids(3, 31))
    stored = session_logits(engine, "hit", ids)
    assert engine.stats.prefix_cache_hits == 36
    torch.testing.assert_close(stored, hf_last_logits(hf, ids), atol=ATOL, rtol=0)
    for rid in ("warm", "hit"):
        engine.close(rid)
    assert engine.kv_pool_all_free


def test_cache_on_and_off_give_identical_batches(tiny_models):
    """Same tokens and logprobs, greedy and seeded, for a batch sharing prefixes."""
    folder, _ = tiny_models["llama"]
    prompts = [PREFIX[: 9 + 4 * i] + prompt_ids(3 + i, 40 + i) for i in range(6)] * 2
    results = []
    for cache in (True, False):
        engine = make_engine(folder, enable_prefix_caching=cache, max_num_batched_tokens=16)
        for i, ids in enumerate(prompts):
            params = GREEDY if i % 2 else SamplingParams(
                temperature=0.9, seed=i, max_tokens=8, logprobs=1, ignore_eos=True)
            engine.add_request(str(i), ids, params)
        outs = run_to_completion(engine)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs)
                        for o in (outs[str(i)] for i in range(len(prompts)))])
        hits = engine.stats.prefix_cache_hits
        assert (hits > 0) == cache and engine.kv_pool_all_free
    assert results[0] == results[1]


def test_session_append_and_resubmission_hit_the_cache(tiny_models):
    folder, hf = tiny_models["qwen2"]
    engine = make_engine(folder)
    engine.add_request("a", PREFIX[:9], GREEDY, session=True)
    run_to_completion(engine)
    engine.append("a", PREFIX[9:])
    run_to_completion(engine)
    history = list(engine.get_session("a").token_ids)
    # A second session re-sends the whole history (a chat client does) plus a new turn.
    turn = prompt_ids(7, 50)
    engine.add_request("b", history + turn, session=True)
    engine.step()
    assert engine.last_scheduler_output.chunks[0].start_pos == (len(history) // 4) * 4
    run_to_completion(engine)
    # ... and the first session appends the same turn: it computes only what it lacks.
    engine.append("a", turn)
    run_to_completion(engine)
    for rid in ("a", "b"):
        ids = list(engine.get_session(rid).token_ids)
        assert ids == history + turn
        torch.testing.assert_close(engine.get_logits(rid), hf_last_logits(hf, ids),
                                   atol=ATOL, rtol=0)
    assert engine.num_recomputed_tokens == 0
    for rid in ("a", "b"):
        engine.close(rid)
    assert engine.kv_pool_all_free


def test_rewind_into_a_shared_block_leaves_other_holders_unchanged(tiny_models):
    folder, hf = tiny_models["gemma3"]
    engine = make_engine(folder)
    ids = PREFIX[:14]  # blocks 0..2 full, block 3 partial
    session_logits(engine, "a", ids)
    session_logits(engine, "b", ids)
    shared = engine.get_session("a").block_ids[:3]
    assert engine.get_session("b").block_ids[:3] == shared
    engine.rewind("a", 5)  # 9 tokens left: the next write lands in shared block 2
    engine.append("a", prompt_ids(6, 60))
    run_to_completion(engine)
    assert engine.get_session("a").block_ids[2] != shared[2]  # written into a private copy
    assert engine.get_session("b").block_ids[:3] == shared
    engine.append("b", prompt_ids(3, 61))  # b reads its (unchanged) shared blocks
    run_to_completion(engine)
    for rid in ("a", "b"):
        toks = list(engine.get_session(rid).token_ids)
        torch.testing.assert_close(engine.get_logits(rid), hf_last_logits(hf, toks),
                                   atol=ATOL, rtol=0)
        engine.close(rid)
    assert engine.kv_pool_all_free


def test_a_preempted_paused_session_resumes_through_the_cache(tiny_models):
    folder, hf = tiny_models["llama"]
    engine = make_engine(folder, num_kv_blocks=24, max_model_len=96)
    ids = PREFIX[:33]  # 9 blocks
    stored = session_logits(engine, "s", ids)
    engine.add_request("big", prompt_ids(64, 70), SamplingParams(max_tokens=1))
    run_to_completion(engine)  # 16 blocks + 9 held > 24: the idle session was preempted
    assert engine.stats.num_preemptions == 1
    assert engine.get_session("s").num_computed_tokens == 0
    engine.append("s", prompt_ids(3, 71))
    run_to_completion(engine)
    # "big" evicted the session's tail blocks first; what survived was shared, not recomputed.
    assert 0 < engine.num_recomputed_tokens < len(ids)
    toks = list(engine.get_session("s").token_ids)
    torch.testing.assert_close(engine.get_logits("s"), hf_last_logits(hf, toks),
                               atol=ATOL, rtol=0)
    assert not torch.equal(stored, engine.get_logits("s"))
    engine.close("s")
    assert engine.kv_pool_all_free


def test_reset_prefix_cache_forgets_and_stats_count_tokens(tiny_models):
    folder, _ = tiny_models["qwen3"]
    engine = make_engine(folder)
    ids = PREFIX + [5]
    for rid in ("a", "b"):
        engine.add_request(rid, ids, SamplingParams(max_tokens=1))
        run_to_completion(engine)
    stats = engine.stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (2 * 37, 36)
    assert stats.as_dict()["prefix_cache_hit_rate"] == pytest.approx(36 / 74)
    assert engine.reset_prefix_cache() == stats.num_cached_kv_blocks > 0
    engine.add_request("c", ids, SamplingParams(max_tokens=1))
    run_to_completion(engine)
    assert engine.stats.prefix_cache_hits == 36  # nothing new was found
    assert engine.kv_pool_all_free


def test_promise_children_and_merged_text_are_cached(tiny_models):
    """A child's own blocks and the parent's merged text are hashed as they fill: requests
    repeating those tokens find them."""
    from engine.test_hooks import P, S, Script, child_plan, params, parent_plan

    from loom.engine.promise_sync import SpecialKwargs

    folder, hf = tiny_models["gemma3"]
    engine = make_engine(folder, special_kwargs=SpecialKwargs(promise_token_id=P,
                                                              sync_token_id=S))
    engine.add_request("t", prompt_ids(9), params(Script(parent_plan, child_plan)),
                       session=True)
    child = run_to_completion(engine)["t"].children[1]
    # prompt (9) + <promise> <promise> + 3 child tokens: block 2 = [p8, P, P, c0] was
    # computed by the child alone; <sync> ends it uncomputed.
    child_ids = child.prompt_token_ids + child.outputs[0].token_ids[:3]
    parent_ids = list(engine.get_session("t").token_ids)  # merged text included, all computed
    for rid, ids, expected_hits in (("c", child_ids + [5, 6], 12),
                                    ("p", parent_ids + [5], len(parent_ids) // 4 * 4)):
        before = engine.stats.prefix_cache_hits
        stored = session_logits(engine, rid, ids)
        assert engine.stats.prefix_cache_hits - before == expected_hits, rid
        torch.testing.assert_close(stored, hf_last_logits(hf, ids), atol=ATOL, rtol=0)
        engine.close(rid)
    engine.close("t")
    assert engine.kv_pool_all_free
