"""The real Gemma 3 270M end to end: greedy equals transformers, sessions equal fresh passes."""

from __future__ import annotations

import pytest
import torch
from engine.helpers import run_to_completion
from tiny_reference import GEMMA_NEW_TOKENS as NEW_TOKENS
from tiny_reference import GEMMA_PROMPTS as PROMPTS

from loom import SamplingParams
from loom.engine.hooks import HookContext, SequenceHook
from loom.engine.promise_sync import join_with_newlines


@pytest.fixture(scope="module")
def engine(gemma_engine):
    yield gemma_engine
    assert gemma_engine.kv_pool_all_free


def assert_greedy_matches(engine, completion, expected: list[int], context: str) -> None:
    """A completion equals transformers' greedy tokens and ended for a stated reason: all
    NEW_TOKENS tokens ("length"), or an end-of-sequence token ("stop"), never cut short."""
    got = completion.token_ids
    assert got, context
    if completion.finish_reason == "length":
        assert len(got) == NEW_TOKENS and got == expected, context
    else:
        assert completion.finish_reason == "stop", context
        assert got[-1] in engine.eos_token_ids and len(got) <= NEW_TOKENS, context
        # transformers stops at the EOS ids its generation config names, which may be fewer.
        assert got == expected[: len(got)], context


def assert_prompts_greedy_match(engine, gemma_hf, prefix: str) -> None:
    """Every prompt of PROMPTS, batched, generates transformers' greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"{prefix}{i}", prompt, params)
    outs = run_to_completion(engine)
    for i, prompt in enumerate(PROMPTS):
        out = outs[f"{prefix}{i}"]
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = gemma_hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert_greedy_matches(engine, out.outputs[0], ref[0, ids.shape[1] :].tolist(), prompt)


def test_greedy_continuations_equal_transformers(engine, gemma_hf):
    assert_prompts_greedy_match(engine, gemma_hf, "g")


def test_prompt_tokens_equal_transformers_tokenizer(engine, gemma_hf_tokenizer):
    for prompt in PROMPTS:
        assert engine.tokenizer.encode(prompt) == gemma_hf_tokenizer(prompt).input_ids


def test_live_session_equals_fresh_forward_on_gemma(engine, gemma_hf):
    engine.add_request("madlib", "The knight's name was", SamplingParams(
        temperature=0.0, max_tokens=5), session=True)
    run_to_completion(engine)
    for fragment in [" and his horse was called", ". They rode to the"]:
        engine.append("madlib", fragment)
        run_to_completion(engine)
        ids = list(engine.get_session("madlib").token_ids)
        with torch.no_grad():
            ref = gemma_hf(torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(engine.get_logits("madlib"), ref, atol=2e-3, rtol=1e-3)
        engine.resume("madlib", SamplingParams(temperature=0.0, max_tokens=4))
        run_to_completion(engine)
    assert engine.num_recomputed_tokens == 0
    engine.close("madlib")


def test_heal_retokenizes_across_the_boundary(engine):
    engine.add_request("h", "Hello wor", session=True)
    run_to_completion(engine)
    engine.append("h", "ld, how are you?", heal=True)
    run_to_completion(engine)
    view = engine.get_session("h")
    assert list(view.token_ids) == engine.tokenizer.encode("Hello world, how are you?")
    engine.close("h")


class ForkSpy(SequenceHook):
    """At each child's first sampled token: its chunk, its block table and reference counts,
    and its parent's block table (read from the engine during that step)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.first: dict[str, tuple[int, int, list[int], list[int], list[int]]] = {}

    def on_token(self, ctx: HookContext, seq_id: str, token_id: int) -> None:
        """Record a child's state the first time it samples."""
        parent = ctx.parent(seq_id)
        if parent is None or seq_id in self.first:
            return
        kv = self.engine.scheduler.kv
        (chunk,) = [c for c in self.engine.last_scheduler_output.chunks if c.request_id == seq_id]
        table = list(kv.block_ids(seq_id))
        refs = [kv.pool.ref_count(b) for b in table]
        self.first[seq_id] = (chunk.start_pos, len(chunk.token_ids), table,
                              list(kv.block_ids(parent)), refs)


def test_fork_join_scene_shares_kv_and_equals_fresh_forward(engine, gemma_hf):
    from loom.demo_fork import SYNC, run_fork_join

    spy = ForkSpy(engine)
    engine.hooks.append(spy)
    try:
        out, script = run_fork_join(engine, "outline-test", close=False)
    finally:
        engine.hooks.remove(spy)
    assert len(out.children) == 3 and all(c.finished for c in out.children)
    # Each child reused its parent's K/V: its first step computed only its <promise>, and its
    # table starts with the parent's full blocks (referenced by both), then a private copy
    # of the parent's partial block.
    assert set(spy.first) == {c.request_id for c in out.children}
    block_size = engine.scheduler.kv.block_size
    for child in out.children:
        start, num_computed, table, parent_table, refs = spy.first[child.request_id]
        forked_at = len(child.prompt_token_ids) - 1  # the parent's K/V up to its <promise>
        assert (start, num_computed) == (forked_at, 1)
        shared = forked_at // block_size
        assert shared >= 1 and table[:shared] == parent_table[:shared]
        assert all(r >= 2 for r in refs[:shared])
        if forked_at % block_size:
            assert table[shared] not in parent_table and refs[shared] == 1
    ids = list(engine.get_session("outline-test").token_ids)
    tok = engine.tokenizer
    # Every child wrote text, and the join appended exactly the merged texts after <sync>.
    texts = [child.outputs[0].text for child in out.children]
    assert all(text.strip() for text in texts), texts
    sync_at = ids.index(tok.token_to_id(SYNC))
    merged = tok.encode(join_with_newlines(texts), add_special_tokens=False)
    assert ids[sync_at + 1 : sync_at + 1 + len(merged)] == merged
    after_sync = tok.decode(ids[sync_at + 1 :])
    for text in texts:
        assert text.strip() in after_sync
    with torch.no_grad():
        ref = gemma_hf(torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(engine.get_logits("outline-test"), ref, atol=2e-3, rtol=1e-3)
        assert len(script.child_first_logits) == 3
        for context, logits in script.child_first_logits:
            ref = gemma_hf(torch.tensor([context])).logits[0, -1].float()
            torch.testing.assert_close(logits, ref, atol=2e-3, rtol=1e-3)
    assert engine.num_recomputed_tokens == 0
    engine.close("outline-test")


REPEATING = (
    "The lamp was lit at dusk. The bell was rung at dawn. The lamp was lit at dusk. "
    "The bell was rung at dawn. The lamp was lit"
)


def test_speculative_decoding_equals_transformers_and_fresh_forward(gemma_path, gemma_hf):
    """n-gram drafts on the real model: greedy tokens equal transformers' and a session's
    logits equal a fresh forward pass; drafts were accepted along the way."""
    from loom.engine.config import EngineArgs
    from loom.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(gemma_path), dtype="float32", quantization=None, num_kv_blocks=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    ))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    for i, prompt in enumerate([REPEATING, *PROMPTS[2:]]):
        engine.add_request(f"s{i}", prompt, params)
        out = run_to_completion(engine)[f"s{i}"]
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = gemma_hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert_greedy_matches(engine, out.outputs[0], ref[0, ids.shape[1] :].tolist(), prompt)
    assert engine.speculator.num_accepted > 0
    engine.add_request("sess", REPEATING, params, session=True)
    run_to_completion(engine)
    engine.append("sess", " at dusk. The bell")
    run_to_completion(engine)
    engine.resume("sess", SamplingParams(temperature=0.0, max_tokens=12))
    run_to_completion(engine)
    ids = list(engine.get_session("sess").token_ids)
    with torch.no_grad():
        ref = gemma_hf(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(engine.get_logits("sess"), ref, atol=2e-3, rtol=1e-3)
    assert engine.num_recomputed_tokens == 0
    engine.close("sess")
    assert engine.kv_pool_all_free


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_gemma_on_cuda_equals_transformers_and_fresh_forward(gemma_path, gemma_hf):
    """The CUDA path (Triton attention, decode steps from CUDA graphs) on the real model, in
    float32: greedy tokens equal transformers', a live session equals a fresh forward."""
    from loom.engine.config import EngineArgs
    from loom.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(gemma_path), dtype="float32", quantization=None, device="cuda",
        num_kv_blocks=256, max_num_seqs=8,
    ))
    assert engine.runner.decode_graphs is not None
    assert_prompts_greedy_match(engine, gemma_hf, "c")
    assert engine.runner.decode_graphs.steps_run > 0
    engine.add_request("madlib", "The knight's name was", SamplingParams(
        temperature=0.0, max_tokens=5), session=True)
    run_to_completion(engine)
    engine.append("madlib", " and his horse was called")
    run_to_completion(engine)
    ids = list(engine.get_session("madlib").token_ids)
    with torch.no_grad():
        ref = gemma_hf(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(engine.get_logits("madlib").cpu(), ref, atol=2e-3, rtol=1e-3)
    assert engine.num_recomputed_tokens == 0
    engine.close("madlib")
    assert engine.kv_pool_all_free
