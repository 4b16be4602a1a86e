"""Forking a paused session into a new one (`fork_session`): the copy shares the parent's
blocks copy-on-write, computes only what it does not share, and neither side changes the
other; its logits equal a fresh session's over the same tokens, bit for bit in the default
mode (the K/V of a shared block is the same K/V)."""

from __future__ import annotations

import pytest
import torch
from engine.helpers import make_engine, prompt_ids, session_logits, settle_session

from loom import SamplingParams
from loom.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    InvalidSessionStateError,
    UnknownRequestError,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("quantization", [None, "w8a8"])
@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_forks_share_blocks_and_equal_fresh_sessions(tiny_models, arch, quantization) -> None:
    folder, _ = tiny_models[arch]
    engine = make_engine(folder, quantization=quantization, enable_prefix_caching=False)
    free_at_start = engine.num_free_blocks
    engine.add_request("a", prompt_ids(13), GREEDY, session=True)
    settle_session(engine, "a")
    parent = engine.get_session("a")
    parent_logits = engine.get_logits("a").clone()
    total = len(parent.token_ids)  # 13 + 6 tokens, blocks of 4

    shared_whole = engine.fork_session("a", "b")
    shared_cut = engine.fork_session("a", "c", num_tokens=10)  # cut inside a block
    assert (shared_whole, shared_cut) == (total - 1, 9)  # each recomputes its last token
    # Full blocks are the parent's own; the cut copy's partial block is its private copy.
    b_blocks = engine.get_session("b").block_ids
    assert b_blocks[: (total - 1) // 4] == parent.block_ids[: (total - 1) // 4]
    assert engine.get_session("c").block_ids[:2] == parent.block_ids[:2]
    assert engine.get_session("c").block_ids[2] != parent.block_ids[2]

    computed_before = engine.stats.num_computed_tokens
    engine.append("b", prompt_ids(5, 1), GREEDY)
    engine.append("c", prompt_ids(7, 2), GREEDY)
    settle_session(engine, "b")
    settle_session(engine, "c")
    # Only what the forks do not share: the last kept token, the fragment, the generated
    # tokens (the last one computed too, as a paused session's is).
    assert engine.stats.num_computed_tokens - computed_before == (1 + 5 + 6) + (1 + 7 + 6)
    # The parent is as it was.
    assert engine.get_session("a").token_ids == parent.token_ids
    assert torch.equal(engine.get_logits("a"), parent_logits)
    # Each fork's tokens: the parent's kept ones, its fragment, 6 greedy tokens; its logits
    # those of a fresh session over the same tokens (the greedy tokens follow from them).
    for rid, keep, fragment in (("b", total, prompt_ids(5, 1)), ("c", 10, prompt_ids(7, 2))):
        view = engine.get_session(rid)
        assert list(view.token_ids[:keep]) == list(parent.token_ids[:keep])
        assert list(view.token_ids[keep:keep + len(fragment)]) == fragment
        assert len(view.token_ids) == keep + len(fragment) + 6
        fresh = session_logits(engine, f"fresh-{rid}", list(view.token_ids))
        if quantization is None:
            torch.testing.assert_close(engine.get_logits(rid), fresh, atol=1e-5, rtol=0)
        else:  # the default mode's guarantee: the same bits however the K/V got there
            assert torch.equal(engine.get_logits(rid), fresh)
        reference = make_engine(folder, quantization=quantization, enable_prefix_caching=False)
        reference.add_request("r", list(view.token_ids[: keep + len(fragment)]), GREEDY,
                              session=True)
        settle_session(reference, "r")
        assert reference.get_session("r").token_ids == view.token_ids
    for rid in ("a", "b", "c"):
        engine.close(rid)
    assert engine.num_free_blocks == free_at_start


def test_fork_refusals_change_nothing(tiny_models) -> None:
    folder, _ = tiny_models["llama"]
    engine = make_engine(folder)
    engine.add_request("a", prompt_ids(9), GREEDY, session=True)
    with pytest.raises(InvalidSessionStateError, match="generating"):
        engine.fork_session("a", "b")
    settle_session(engine, "a")
    total = len(engine.get_session("a").token_ids)
    for bad in (0, total + 1):
        with pytest.raises(InvalidRequestError, match=f"1..{total}"):
            engine.fork_session("a", "b", num_tokens=bad)
    with pytest.raises(DuplicateRequestError):
        engine.fork_session("a", "a")
    with pytest.raises(UnknownRequestError):
        engine.fork_session("nope", "b")
    assert not engine.is_live("b")
    engine.add_request("plain", prompt_ids(5), GREEDY)
    with pytest.raises(InvalidSessionStateError, match="not a session"):
        engine.fork_session("plain", "b")
    assert engine.fork_session("a", "b", num_tokens=1) == 0
    settle_session(engine, "b")
    assert engine.get_session("b").token_ids == engine.get_session("a").token_ids[:1]
