"""The demo's fork/join scene checked on a real model against transformers (Gemma 3 and
SmolLM2 run it): children share the parent's KV, the join appends exactly the merged texts,
and every logits row the scene produced equals a fresh forward pass."""

from __future__ import annotations

import torch

from loom.demo_fork import ITEMS, opening, run_fork_join
from loom.engine.hooks import HookContext, SequenceHook
from loom.engine.promise_sync import join_with_newlines


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


def check_fork_join_scene(engine, hf_model, request_id: str = "outline-test") -> list[str]:
    """Run the scene on `engine` (float32, exact weights, built with the scene's special
    tokens) and check it against `hf_model`; returns the children's texts."""
    recomputed = engine.num_recomputed_tokens
    spy = ForkSpy(engine)
    engine.hooks.append(spy)
    try:
        out, script = run_fork_join(engine, request_id, close=False)
    finally:
        engine.hooks.remove(spy)
    assert len(out.children) == len(ITEMS) and all(c.finished for c in out.children)
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
    ids = list(engine.get_session(request_id).token_ids)
    tok = engine.tokenizer
    # Each child wrote its item's sentence on one line, and the join appended exactly the
    # merged texts after <sync>.
    texts = [child.outputs[0].text for child in out.children]
    for item, text in zip(ITEMS, texts, strict=True):
        assert text.startswith(opening(item)) and len(text.strip()) > len(opening(item)), texts
        assert "\n" not in text.strip(), texts
    sync_at = ids.index(script.sync_id)
    merged = tok.encode(join_with_newlines(texts), add_special_tokens=False)
    assert ids[sync_at + 1 : sync_at + 1 + len(merged)] == merged
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(engine.get_logits(request_id), ref, atol=2e-3, rtol=1e-3)
        assert len(script.child_first_logits) == len(ITEMS)
        for context, logits in script.child_first_logits:
            ref = hf_model(torch.tensor([context])).logits[0, -1].float()
            torch.testing.assert_close(logits, ref, atol=2e-3, rtol=1e-3)
    assert engine.num_recomputed_tokens == recomputed
    engine.close(request_id)
    return texts
