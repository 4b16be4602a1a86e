"""Sequence hooks on a tiny model with scripted tokens: fork, block, join, user hooks, leaks."""

from __future__ import annotations

import asyncio

import torch
from engine.helpers import make_engine, prompt_ids, run_to_completion
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_reference import hf_last_logits

from loom import SamplingParams
from loom.engine.async_engine import AsyncLLMEngine
from loom.engine.hooks import HookContext, SequenceHook
from loom.engine.promise_sync import SpecialKwargs

P, S, TOOL = 10, 11, 12  # promise, sync and "tool call end" token ids of the tiny vocab
NEG = -1e9


class Script:
    """A logits processor forcing tokens by rule: (context, output) -> token or None (model).

    It also records the raw logits it sees, keyed by the full token sequence, so tests can
    compare them with transformers' forward pass on the same tokens.
    """

    def __init__(self, parent_plan, child_plan):
        self.parent_plan = parent_plan
        self.child_plan = child_plan
        self.seen: list[tuple[list[int], torch.Tensor]] = []

    def __call__(self, prompt, output, logits):
        self.seen.append((list(prompt) + list(output), logits.clone()))
        is_child = prompt[-1] == P
        plan = self.child_plan(prompt, output) if is_child else self.parent_plan(output)
        if plan is None:
            logits[P] = logits[S] = logits[TOOL] = NEG  # the model itself never emits them
            return logits
        forced = torch.full_like(logits, NEG)
        forced[plan] = 0.0
        return forced


def parent_plan(output):
    """<promise> <promise> x <sync> (merge) then the model, 6 tokens."""
    script = [P, P, 40, S]
    return script[len(output)] if len(output) < len(script) else None


def child_plan(prompt, output):
    """Each child writes 3 model tokens then <sync>."""
    return S if len(output) == 3 else None


def params(script, max_tokens=14, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          logits_processors=[script], **kw)


def test_promise_sync_tree_equals_fresh_forward(tiny_models, device):
    folder, hf = tiny_models["gemma3"]
    engine = make_engine(folder, special_kwargs=SpecialKwargs(promise_token_id=P,
                                                              sync_token_id=S), device=device)
    script = Script(parent_plan, child_plan)
    prompt = prompt_ids(9)
    engine.add_request("t", prompt, params(script), session=True)
    outs = run_to_completion(engine)
    out = outs["t"]
    assert len(out.children) == 2 and all(c.finished for c in out.children)
    # Each child's prompt is the parent's context up to (and including) its own <promise>,
    # and its logits processor saw that prompt, then the child's 3 tokens, then <sync>.
    assert [c.prompt_token_ids for c in out.children] == [prompt + [P], prompt + [P, P]]
    seen_contexts = [t for t, _ in script.seen]
    for child in out.children:
        assert len(child.outputs[0].token_ids) == 4 and child.outputs[0].token_ids[3] == S
        assert child.prompt_token_ids + child.outputs[0].token_ids[:3] in seen_contexts
    ids = list(engine.get_session("t").token_ids)
    # The merged children's text follows <sync>, then the model continues.
    child_texts = [engine.tokenizer.decode(c.outputs[0].token_ids[:-1]) for c in out.children]
    merged = engine.tokenizer.encode("\n".join(t.strip("\n") for t in child_texts) + "\n",
                                     add_special_tokens=False)
    sync_at = len(prompt) + 3
    assert ids[: sync_at + 1] == prompt + [P, P, 40, S]
    assert ids[sync_at + 1 : sync_at + 1 + len(merged)] == merged
    # Logits rows seen before the merge equal transformers' forward pass (processors see the
    # prompt and the generated tokens, which is the whole context until a merge appends
    # text; after it, the stored logits below cover the parent).
    checked = 0
    for tokens, logits in script.seen:
        if S not in tokens[len(prompt) :]:
            torch.testing.assert_close(logits.cpu(), hf_last_logits(hf, tokens), atol=1e-4,
                                       rtol=0)
            checked += 1
    assert checked >= 10
    torch.testing.assert_close(engine.get_logits("t").cpu(), hf_last_logits(hf, ids),
                               atol=1e-4, rtol=0)
    engine.close("t")
    assert engine.kv_pool_all_free


def test_blocked_parent_not_scheduled_and_merge_prefills_only_merged_tokens(tiny_models):
    folder, _ = tiny_models["llama"]
    engine = make_engine(folder, special_kwargs=SpecialKwargs(promise_token_id=P,
                                                              sync_token_id=S))
    script = Script(parent_plan, lambda prompt, output: S if len(output) == 8 else None)
    engine.add_request("t", prompt_ids(9), params(script))
    blocked_steps = 0
    merge_chunk = None
    while engine.has_unfinished_requests():
        seq = engine.table.get("t")
        was_blocked = seq is not None and seq.blocked
        engine.step()
        chunks = {c.request_id: c for c in engine.last_scheduler_output.chunks}
        if was_blocked:
            blocked_steps += 1
            assert "t" not in chunks
        if merge_chunk is None and "t" in chunks and chunks["t"].token_ids[0] == S:
            merge_chunk = chunks["t"]
            # The step computed <sync> and the merged tokens, then sampled one more.
            after = engine.table["t"].request.token_ids
            assert merge_chunk.start_pos == 9 + 3 and merge_chunk.end_pos == len(after) - 1
            merged = engine.table["t"].output_token_ids[4:-1]
            assert merge_chunk.token_ids == [S, *merged] and len(merged) > 3
    assert blocked_steps >= 4
    assert merge_chunk is not None
    assert engine.kv_pool_all_free


def test_children_share_the_parent_kv(tiny_models):
    folder, _ = tiny_models["qwen3"]
    n_children = 6
    engine = make_engine(folder, num_kv_blocks=400, block_size=4, max_num_batched_tokens=512,
                         special_kwargs=SpecialKwargs(promise_token_id=P, sync_token_id=S))

    def plan(output):
        script = [P] * n_children + [S]
        return script[len(output)] if len(output) < len(script) else None

    script = Script(plan, lambda prompt, output: S if len(output) == 5 else None)
    engine.add_request("t", prompt_ids(400), params(script, max_tokens=n_children + 3))
    computed: dict[str, int] = {}
    peak_used = 0
    while engine.has_unfinished_requests():
        engine.step()
        for c in engine.last_scheduler_output.chunks:
            computed[c.request_id] = computed.get(c.request_id, 0) + len(c.token_ids)
        peak_used = max(peak_used, 400 - engine.num_free_blocks)
    children = [rid for rid in computed if rid != "t"]
    assert len(children) == n_children
    for child in children:
        assert computed[child] == 1 + 5  # its <promise> and its own tokens, no shared prefix
    parent_blocks = (400 + n_children + 3 + 16) // 4 + 1
    assert peak_used <= parent_blocks + n_children * 3  # each child: a few blocks of its own
    assert engine.num_recomputed_tokens == 0
    assert engine.kv_pool_all_free


class ToolHook(SequenceHook):
    """On the tool-call end token, run an async tool and append its result."""

    def __init__(self, result_ids):
        self.result_ids = result_ids
        self.calls = 0

    def on_token(self, ctx: HookContext, seq_id: str, token_id: int) -> None:
        if token_id != TOOL:
            return

        async def tool():
            self.calls += 1
            await asyncio.sleep(0.01)
            return self.result_ids

        ctx.run_async(seq_id, tool)


def _tool_plan(output):
    script = [50, TOOL]
    return script[len(output)] if len(output) < len(script) else None


def test_user_hook_runs_async_tool_and_keeps_kv(tiny_models):
    folder, hf = tiny_models["gemma3"]
    result = [60, 61, 62]
    hook = ToolHook(result)
    engine = make_engine(folder, hooks=[hook])
    script = Script(_tool_plan, child_plan)
    prompt = prompt_ids(8)
    engine.add_request("a", prompt, params(script, max_tokens=6), session=True)
    run_to_completion(engine)
    ids = list(engine.get_session("a").token_ids)
    assert hook.calls == 1
    assert ids[: len(prompt) + 5] == prompt + [50, TOOL, *result]
    assert engine.num_recomputed_tokens == 0
    torch.testing.assert_close(engine.get_logits("a"), hf_last_logits(hf, ids), atol=1e-4,
                               rtol=0)
    for tokens, logits in script.seen:
        if TOOL not in tokens:
            torch.testing.assert_close(logits, hf_last_logits(hf, tokens), atol=1e-4, rtol=0)

    async def via_async_engine():
        aengine = AsyncLLMEngine(make_engine(folder, hooks=[hook]))
        final = None
        async for out in aengine.generate(prompt, params(Script(_tool_plan, child_plan),
                                                         max_tokens=6)):
            final = out
        return final

    final = asyncio.run(via_async_engine())
    assert final.finished and hook.calls == 2
    assert final.outputs[0].token_ids == ids[len(prompt):]


def run_random_trees(folder, num_blocks, plans, abort_first=False):
    """Requests whose sequences follow `plans` (promise, sync or model tokens) to the end."""
    engine = make_engine(folder, num_kv_blocks=num_blocks, block_size=4,
                         max_num_batched_tokens=24,
                         special_kwargs=SpecialKwargs(promise_token_id=P, sync_token_id=S,
                                                      max_depth=2, max_children=3))
    for i, plan in enumerate(plans):
        def parent(output, plan=plan):
            return plan[len(output)] if len(output) < len(plan) else None

        def child(prompt, output, plan=plan):
            return plan[len(output)] if len(output) < len(plan) else (
                S if len(output) > 4 else None)

        engine.add_request(str(i), prompt_ids(5 + 7 * i, i),
                           params(Script(parent, child), max_tokens=10))
    if abort_first:
        engine.step()
        engine.abort_request("0")
    for out in run_to_completion(engine).values():
        assert out.finished
    assert engine.kv_pool_all_free
    assert not list(engine.table)
    return engine


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), num_blocks=st.integers(14, 60))
def test_random_trees_never_leak(tiny_models, data, num_blocks):
    plans = data.draw(st.lists(st.lists(st.sampled_from([P, S, None, None]), max_size=8),
                               min_size=1, max_size=3))
    run_random_trees(tiny_models["qwen2"][0], num_blocks, plans, data.draw(st.booleans()))


def test_forked_children_waiting_with_blocks_do_not_starve_an_older_sequence(tiny_models):
    """A child that needs almost the whole pool once its own children merged: the waiting
    grandchildren of another branch hold forked blocks; they are evicted (and recompute)
    instead of the child preempting itself forever (found by the random-tree test)."""
    engine = run_random_trees(tiny_models["qwen2"][0], 14, [[P, P, P], [P]])
    assert engine.scheduler.num_preemptions > 0


def test_trees_under_preemption_never_leak(tiny_models):
    plans = [[S, S, None], [P], [None, P, None, None, P]]
    engine = run_random_trees(tiny_models["qwen2"][0], 20, plans)
    assert engine.scheduler.num_preemptions > 0
