"""Live sessions on tiny models: the stored logits always equal a fresh forward pass."""

from __future__ import annotations

import pytest
import torch
from engine.helpers import make_engine, prompt_ids, run_to_completion, session_logits
from tiny_reference import hf_last_logits

from loom import SamplingParams
from loom.errors import (
    InvalidRequestError,
    InvalidSessionStateError,
    PromptTooLongError,
    SessionClosedError,
    UnknownRequestError,
)
from loom.sample import filtered_probs

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ATOL = 1e-4


def settle(engine):
    """Step until nothing runs."""
    return run_to_completion(engine)


def step_until_paused(engine, rid, steps=None):
    """Step until session `rid` is paused (other requests may go on running); the last output
    of every request, by id. `steps` collects the request ids of each step's chunks."""
    last = {}
    for _ in range(10_000):
        if engine.get_session(rid).status == "PAUSED":
            return last
        for out in engine.step():
            last[out.request_id] = out
        if steps is not None:
            steps.append({c.request_id for c in engine.last_scheduler_output.chunks})
    raise AssertionError(f"session {rid} never paused")


def assert_logits_fresh(engine, hf, rid):
    """The stored logits equal transformers' on the session's tokens, and a fresh Loom request."""
    view = engine.get_session(rid)
    assert view.num_computed_tokens == len(view.token_ids)
    stored = engine.get_logits(rid).cpu()
    torch.testing.assert_close(stored, hf_last_logits(hf, list(view.token_ids)), atol=ATOL, rtol=0)
    fresh_id = f"fresh-{rid}-{len(view.token_ids)}"
    engine.add_request(fresh_id, list(view.token_ids), session=True)
    step_until_paused(engine, fresh_id)
    torch.testing.assert_close(engine.get_logits(fresh_id).cpu(), stored, atol=ATOL, rtol=0)
    engine.close(fresh_id)


def assert_greedy_consistent(hf, token_ids, generated_ranges):
    """Every generated token is the argmax of transformers' logits over its prefix."""
    for start, end in generated_ranges:
        for i in range(start, end):
            assert token_ids[i] == int(hf_last_logits(hf, token_ids[:i]).argmax()), i


@pytest.mark.parametrize("arch", ["gemma3", "llama", "qwen3"])
def test_alternating_session_equals_fresh_forward(tiny_models, arch, device):
    folder, hf = tiny_models[arch]
    engine = make_engine(folder, max_num_batched_tokens=8, device=device)
    engine.add_request("s", prompt_ids(11), GREEDY, session=True)
    # A batch partner that decodes through every segment: each prefill and generation of
    # the session shares its steps with another running request.
    engine.add_request("plain", prompt_ids(30, 5), SamplingParams(max_tokens=400, ignore_eos=True))
    ranges = []
    steps: list[set[str]] = []  # the request ids of each step after the first segment
    for k in range(3):
        start = engine.get_session("s").num_prompt_tokens if k == 0 else None
        out = step_until_paused(engine, "s", steps if k else None)["s"]
        assert not out.finished and out.outputs[0].finish_reason == "length"
        assert engine.get_session("s").status == "PAUSED"
        if start is not None:
            ranges.append((start, start + 6))
        assert_logits_fresh(engine, hf, "s")
        engine.append("s", prompt_ids(5 + 7 * k, 10 + k))  # chunked: budget is 8
        step_until_paused(engine, "s", steps)
        assert_logits_fresh(engine, hf, "s")
        before = len(engine.get_session("s").token_ids)
        engine.resume("s", GREEDY)
        ranges.append((before, before + 6))
    out = step_until_paused(engine, "s", steps)["s"]
    assert out.outputs[0].finish_reason == "length"
    # Every later segment ran batched with the partner, which is still decoding.
    session_steps = [ids for ids in steps if "s" in ids]
    assert len(session_steps) >= 3 * (1 + 6) and all("plain" in ids for ids in session_steps)
    assert engine.has_unfinished_requests()
    assert_greedy_consistent(hf, list(engine.get_session("s").token_ids), ranges)
    assert engine.num_recomputed_tokens == 0
    engine.close("s")
    engine.abort_request("plain")
    assert engine.kv_pool_all_free


def test_append_keeps_blocks_and_computes_only_new_tokens(tiny_models):
    folder, _ = tiny_models["qwen3"]
    engine = make_engine(folder, max_num_batched_tokens=64)
    engine.add_request("s", prompt_ids(21), GREEDY, session=True)
    settle(engine)
    view = engine.get_session("s")
    computed_blocks = view.block_ids[: (view.num_computed_tokens + 3) // 4]
    engine.append("s", prompt_ids(9, 2))
    engine.step()
    (chunk,) = engine.last_scheduler_output.chunks
    assert chunk.start_pos == view.num_computed_tokens and len(chunk.token_ids) == 9
    after = engine.get_session("s")
    assert after.block_ids[: len(computed_blocks)] == computed_blocks
    assert engine.num_recomputed_tokens == 0
    engine.close("s")
    assert engine.kv_pool_all_free


def test_prefill_in_the_middle_of_a_segment_continues_generation(tiny_models):
    folder, hf = tiny_models["gemma3"]
    engine = make_engine(folder)
    engine.add_request("s", prompt_ids(7), SamplingParams(temperature=0.0, max_tokens=10,
                                                          ignore_eos=True), session=True)
    engine.step()
    engine.step()
    engine.step()
    n_before = len(engine.get_session("s").token_ids)
    engine.append("s", prompt_ids(4, 9))
    out = settle(engine)["s"]
    ids = list(engine.get_session("s").token_ids)
    # 3 generated before the fragment (the third one pending), the rest after it.
    assert len(out.outputs[0].token_ids) == 10 + 4
    assert_greedy_consistent(hf, ids, [(7, n_before), (n_before + 4, len(ids))])
    assert_logits_fresh(engine, hf, "s")


def test_rewind_then_continue_equals_fresh(tiny_models):
    folder, hf = tiny_models["llama"]
    engine = make_engine(folder)
    engine.add_request("s", prompt_ids(13), GREEDY, session=True)
    settle(engine)
    blocks_before = engine.num_free_blocks
    engine.rewind("s", 9)
    settle(engine)
    assert len(engine.get_session("s").token_ids) == 13 + 6 - 9
    assert engine.num_free_blocks >= blocks_before + 1
    assert_logits_fresh(engine, hf, "s")
    engine.append("s", prompt_ids(3, 4), SamplingParams(temperature=0.0, max_tokens=3,
                                                         ignore_eos=True))
    settle(engine)
    ids = list(engine.get_session("s").token_ids)
    assert_greedy_consistent(hf, ids, [(len(ids) - 3, len(ids))])


def test_paused_sessions_preempted_first_and_resume_identically(tiny_models):
    folder, hf = tiny_models["qwen2"]
    engine = make_engine(folder, num_kv_blocks=20, max_num_batched_tokens=32)
    engine.add_request("old", prompt_ids(20), GREEDY, session=True)
    settle(engine)
    engine.add_request("pinned", prompt_ids(10, 1), GREEDY, session=True, pin=True)
    settle(engine)
    stored = engine.get_logits("old")
    engine.add_request("big", prompt_ids(40, 2), SamplingParams(max_tokens=4, ignore_eos=True))
    settle(engine)
    assert engine.get_session("old").num_computed_tokens == 0  # preempted
    assert engine.get_session("pinned").num_computed_tokens > 0
    torch.testing.assert_close(engine.get_logits("old"), stored)  # logits survive preemption
    engine.resume("old", GREEDY)
    settle(engine)
    assert engine.num_recomputed_tokens > 0
    ids = list(engine.get_session("old").token_ids)
    assert_greedy_consistent(hf, ids, [(20, 26), (26, 32)])
    assert_logits_fresh(engine, hf, "old")


def test_resample_matches_filtered_softmax_and_changes_nothing(tiny_models):
    folder, _ = tiny_models["gemma3"]
    engine = make_engine(folder)
    engine.add_request("s", prompt_ids(12), session=True)
    settle(engine)
    logits = engine.get_logits("s")
    view = engine.get_session("s")
    greedy = engine.resample("s", SamplingParams(temperature=0.0), n=5)
    assert {s.token_id for s in greedy} == {int(logits.argmax())}
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=3)
    draws = engine.resample("s", params, n=4000)
    probs = filtered_probs(logits, params)
    counts = torch.bincount(torch.tensor([d.token_id for d in draws]), minlength=probs.numel())
    tv = 0.5 * (counts / counts.sum() - probs).abs().sum()
    assert tv < 0.06
    assert all(probs[d.token_id] > 0 for d in draws)
    assert engine.get_session("s") == view
    again = engine.resample("s", params, n=20)
    assert [d.token_id for d in again] == [d.token_id for d in draws[:20]]


def test_session_errors_are_clear_and_leave_state_unchanged(tiny_models):
    folder, _ = tiny_models["llama"]
    engine = make_engine(folder, max_model_len=40)
    with pytest.raises(UnknownRequestError, match="ghost"):
        engine.append("ghost", "hi")
    engine.add_request("s", prompt_ids(10), SamplingParams(max_tokens=30, ignore_eos=True),
                       session=True)
    with pytest.raises(InvalidSessionStateError, match="no stored logits"):
        engine.resample("s")
    engine.step()
    with pytest.raises(InvalidSessionStateError, match="generating"):
        engine.resume("s", GREEDY)
    settle(engine)
    view = engine.get_session("s")
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.append("s", "")
    with pytest.raises(PromptTooLongError, match="max_model_len=40"):
        engine.append("s", prompt_ids(30))
    assert engine.get_session("s") == view
    with pytest.raises(PromptTooLongError, match="max_model_len=40"):
        engine.resume("s", GREEDY)  # the session is at the limit: 10 + 30 tokens
    with pytest.raises(InvalidRequestError):
        engine.rewind("s", 0)
    engine.add_request("plain", prompt_ids(4), GREEDY)
    with pytest.raises(InvalidSessionStateError, match="not a session"):
        engine.append("plain", [5], GREEDY)  # a new segment needs a session
    with pytest.raises(InvalidSessionStateError, match="not a session"):
        engine.append("plain", "x", heal=True)
    engine.close("s")
    with pytest.raises(SessionClosedError, match="closed"):
        engine.append("s", "more")
    settle(engine)
    assert engine.kv_pool_all_free


def test_expired_sessions_are_freed(tiny_models):
    folder, _ = tiny_models["llama"]
    engine = make_engine(folder, session_ttl_s=0.0)
    engine.add_request("s", prompt_ids(10), session=True)
    settle(engine)
    engine.step()
    with pytest.raises(SessionClosedError, match="expired"):
        engine.get_session("s")
    assert engine.kv_pool_all_free


def test_request_that_cannot_fit_beside_pinned_sessions_fails_clearly(tiny_models):
    folder, hf = tiny_models["llama"]
    engine = make_engine(folder, num_kv_blocks=12, max_num_batched_tokens=64)
    engine.add_request("pinned", prompt_ids(30), session=True, pin=True)
    settle(engine)
    engine.add_request("big", prompt_ids(30, 1), SamplingParams(max_tokens=4))
    outs = settle(engine)
    assert outs["big"].finished and outs["big"].outputs[0].finish_reason == "error"
    assert "cannot be scheduled" in outs["big"].error and "pinned" in outs["big"].error
    assert engine.get_session("pinned").num_computed_tokens == 30
    torch.testing.assert_close(engine.get_logits("pinned"), hf_last_logits(hf, prompt_ids(30)),
                               atol=ATOL, rtol=0)
    engine.close("pinned")
    assert engine.kv_pool_all_free


def test_float16_kv_cache_session_equals_fresh_forward(tiny_models):
    """kv_cache_dtype="float16": prefill and decode both attend over the rounded cache, so a
    session that alternates equals a fresh pass over its tokens (up to K/V computed by
    different kernels rounding differently) and stays near the float32 reference."""
    folder, hf = tiny_models["gemma3"]
    engine = make_engine(folder, max_num_batched_tokens=8, kv_cache_dtype="float16")
    assert engine.runner.kv_caches[0].dtype == torch.float16
    engine.add_request("s", prompt_ids(11), GREEDY, session=True)
    settle(engine)
    engine.append("s", prompt_ids(9, 10))
    settle(engine)
    engine.resume("s", GREEDY)
    settle(engine)
    tokens = list(engine.get_session("s").token_ids)
    stored = engine.get_logits("s")
    engine.add_request("fresh", tokens, session=True)
    settle(engine)
    scale = float(stored.abs().max())
    torch.testing.assert_close(engine.get_logits("fresh"), stored, atol=1e-3 * scale, rtol=0)
    torch.testing.assert_close(stored, hf_last_logits(hf, tokens), atol=0.02 * scale, rtol=0)
    engine.close("s")
    engine.close("fresh")
    assert engine.num_recomputed_tokens == 0
    assert engine.kv_pool_all_free


def test_unknown_kv_cache_dtype_is_rejected(tiny_models):
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype 'int4'"):
        make_engine(tiny_models["llama"][0], kv_cache_dtype="int4")


def test_any_live_request_takes_a_fragment_and_generates_as_a_fresh_request(tiny_models):
    """The seed's calls on a plain request: add, step, `prefill` a fragment mid-generation.
    It goes on generating after the fragment; every token after it is transformers' greedy
    token over the whole sequence (prompt, tokens so far, fragment), as a fresh request on
    those tokens generates them."""
    folder, hf = tiny_models["llama"]
    engine = make_engine(folder)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = prompt_ids(9)
    engine.add_request("req1", prompt, params)
    engine.step()  # the prompt and the first token
    engine.step()  # a second token
    fragment = [11, 12, 13]
    assert engine.prefill("req1", fragment) == 3
    out = settle(engine)["req1"].outputs[0]
    tokens = prompt + list(out.token_ids)
    at = tokens.index(11, len(prompt))
    assert tokens[at:at + 3] == fragment and at == len(prompt) + 2
    assert len(out.token_ids) == 8 + 3  # the fragment is input: max_tokens counts generated
    assert_greedy_consistent(hf, tokens, [(len(prompt), at), (at + 3, len(tokens))])
    engine.add_request("fresh", tokens[:at + 3], SamplingParams(
        temperature=0.0, max_tokens=len(tokens) - at - 3, ignore_eos=True))
    fresh = settle(engine)["fresh"].outputs[0]
    assert list(fresh.token_ids) == tokens[at + 3:]
    with pytest.raises(UnknownRequestError, match="already"):
        engine.prefill("req1", [5])  # it ended
    assert engine.kv_pool_all_free


def test_the_async_engine_takes_the_seeds_prefill_call(tiny_models):
    import asyncio

    from loom.engine.async_engine import AsyncLLMEngine
    from loom.engine.config import EngineArgs

    folder, _ = tiny_models["llama"]

    async def main():
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(folder)))
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        await engine.add_request("req1", prompt_ids(6), params)
        await engine.step()
        appended = await engine.prefill("req1", [21, 22])
        last = None
        async for out in engine.outputs("req1"):
            last = out
        return appended, last

    appended, last = asyncio.run(main())
    assert appended == 2
    tokens = list(last.outputs[0].token_ids)
    assert tokens[1:3] == [21, 22] and len(tokens) == 5 + 2  # after the first token


def test_a_plain_request_resamples_from_the_logits_after_its_fragment(tiny_models):
    """The seed: "after a prefill the last logits are stored so the caller can resample".
    A plain request keeps the logits row at the end of its last appended fragment (the one
    its next token was drawn from): equal to a fresh session's over the same tokens, drawn
    from greedily they give that next token; nothing else changes."""
    import asyncio

    from loom.engine.async_engine import AsyncLLMEngine

    folder, _ = tiny_models["llama"]
    engine = make_engine(folder, quantization="w8a8")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = prompt_ids(9)
    engine.add_request("req1", prompt, params)
    engine.step()
    with pytest.raises(InvalidSessionStateError, match="fragment appended"):
        engine.resample("req1")  # no prefill yet
    engine.prefill("req1", [11, 12, 13])
    engine.step()  # the fragment computed, the next token drawn from its last row
    stored = engine.get_logits("req1")
    tokens = list(engine.table["req1"].request.token_ids)
    at = tokens.index(13, len(prompt)) + 1
    greedy = engine.resample("req1", SamplingParams(temperature=0.0))[0]
    assert greedy.token_id == tokens[at] == int(stored.argmax())
    assert torch.equal(stored, session_logits(engine, "fresh", tokens[:at]))
    settle(engine)
    with pytest.raises(UnknownRequestError, match="already"):
        engine.resample("req1")  # it ended

    async def main():
        aengine = AsyncLLMEngine(make_engine(folder))
        await aengine.add_request("req1", prompt, params)
        await aengine.step()
        await aengine.prefill("req1", [11, 12, 13])
        samples = await aengine.resample("req1", SamplingParams(temperature=0.0), n=2)
        async for _ in aengine.outputs("req1"):
            pass
        return samples

    samples = asyncio.run(main())
    assert len(samples) == 2 and samples[0].token_id == samples[1].token_id
