"""Randomized sessions and plain requests on a small block pool (hypothesis, stateful).

Many sessions and plain requests go through random operations: open, prefill (with or
without a new segment), resume, rewind, step, close, abort, and a check of a paused
session's stored logits against a fresh forward pass. At the end every session's stored
logits equal a fresh forward pass over its tokens (sessions sharing prefixes go through the
prefix cache), closing everything leaves the pool fully free, and the whole run took a
number of engine steps bounded by its work (liveness).

`LOOM_STATEFUL_EXAMPLES` / `LOOM_STATEFUL_STEPS` raise the search (defaults 100 x 50).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from engine.helpers import liveness_bound, make_engine
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tiny_reference import hf_last_logits

from loom import SamplingParams
from loom.errors import InvalidSessionStateError, PromptTooLongError

TOKENS = st.lists(st.integers(3, 500), min_size=1, max_size=12)
GEN = st.builds(
    lambda n, greedy: SamplingParams(temperature=0.0 if greedy else 1.0, seed=5, max_tokens=n,
                                     ignore_eos=True),
    st.integers(1, 5), st.booleans(),
)


EXAMPLES = int(os.environ.get("LOOM_STATEFUL_EXAMPLES", "100"))
STEPS = int(os.environ.get("LOOM_STATEFUL_STEPS", "50"))


@pytest.fixture(scope="module")
def tiny_qwen(tiny_models):
    return tiny_models["qwen2"]


def test_stateful_sessions(tiny_qwen):
    folder, hf = tiny_qwen

    class Sessions(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.engine = make_engine(folder, num_kv_blocks=28, block_size=4,
                                      max_num_batched_tokens=10, max_model_len=96)
            self.sessions: list[str] = []
            self.plain: list[str] = []
            self.counter = 0
            self.work = 0  # tokens to compute or generate that the run was given
            self.checked = 0

        def _give(self, num_tokens, params):
            self.work += num_tokens + (params.max_tokens if params is not None else 0)

        def _step_bound(self):
            return liveness_bound(self.work)

        def _new_id(self, kind):
            self.counter += 1
            return f"{kind}{self.counter}"

        @rule(prompt=TOKENS, params=st.one_of(st.none(), GEN), pin=st.booleans())
        def open_session(self, prompt, params, pin):
            rid = self._new_id("s")
            self.engine.add_request(rid, prompt, params, session=True, pin=pin)
            self.sessions.append(rid)
            self._give(len(prompt), params)

        @precondition(lambda self: self.sessions)
        @rule(data=st.data(), suffix=TOKENS, params=st.one_of(st.none(), GEN), pin=st.booleans())
        def open_sharing_session(self, data, suffix, params, pin):
            """A session whose prompt repeats a prefix of another's tokens (a prefix-cache hit
            when those blocks are computed, or still cached after the other moved on)."""
            other = self.engine.get_session(data.draw(st.sampled_from(self.sessions))).token_ids
            keep = data.draw(st.integers(1, len(other)))
            prompt = [*other[:keep], *suffix][:90]
            rid = self._new_id("s")
            self.engine.add_request(rid, prompt, params, session=True, pin=pin)
            self.sessions.append(rid)
            self._give(len(prompt), params)

        @rule(prompt=TOKENS, n=st.integers(1, 6))
        def add_plain(self, prompt, n):
            rid = self._new_id("p")
            params = SamplingParams(max_tokens=n, ignore_eos=True)
            self.engine.add_request(rid, prompt, params)
            self.plain.append(rid)
            self._give(len(prompt), params)

        @precondition(lambda self: self.sessions)
        @rule(data=st.data(), fragment=TOKENS, params=st.one_of(st.none(), GEN))
        def prefill(self, data, fragment, params):
            rid = data.draw(st.sampled_from(self.sessions))
            before = self.engine.get_session(rid)
            try:
                self.engine.append(rid, fragment, params)
            except PromptTooLongError:
                assert self.engine.get_session(rid) == before
            else:
                self._give(len(fragment) + 1, params)  # + the pending sampled token

        @precondition(lambda self: self.sessions)
        @rule(data=st.data(), params=GEN)
        def resume(self, data, params):
            rid = data.draw(st.sampled_from(self.sessions))
            with contextlib.suppress(InvalidSessionStateError, PromptTooLongError):
                self.engine.resume(rid, params)
                self._give(1, params)

        @precondition(lambda self: self.sessions)
        @rule(data=st.data(), k=st.integers(1, 6))
        def rewind(self, data, k):
            rid = data.draw(st.sampled_from(self.sessions))
            view = self.engine.get_session(rid)
            if view.generating or k >= len(view.token_ids):
                return
            self.engine.rewind(rid, k)
            self._give(1, None)  # the new last token is computed again

        @rule(n=st.integers(1, 4))
        def step(self, n):
            for _ in range(n):
                self._handle(self.engine.step())

        def _handle(self, outputs):
            for out in outputs:
                if out.error is not None:  # pool held by pinned sessions: it was failed
                    assert "cannot be scheduled" in out.error
                    self._forget(out.request_id)

        @precondition(lambda self: self.sessions)
        @rule(data=st.data())
        def check_logits(self, data):
            rid = data.draw(st.sampled_from(self.sessions))
            seq = self.engine.table[rid]
            if seq.generating or seq.last_logits is None or seq.request.num_uncomputed_tokens:
                return  # no stored logits for the current tokens yet
            ref = hf_last_logits(hf, list(self.engine.get_session(rid).token_ids))
            torch.testing.assert_close(self.engine.get_logits(rid), ref, atol=1e-4, rtol=0)
            self.checked += 1

        def _forget(self, rid):
            for ids in (self.sessions, self.plain):
                if rid in ids:
                    ids.remove(rid)

        @precondition(lambda self: self.sessions)
        @rule(data=st.data())
        def close(self, data):
            rid = data.draw(st.sampled_from(self.sessions))
            self.engine.close(rid)
            self.sessions.remove(rid)

        @precondition(lambda self: self.plain)
        @rule(data=st.data())
        def abort(self, data):
            rid = data.draw(st.sampled_from(self.plain))
            self.plain.remove(rid)
            if self.engine.is_live(rid):
                self.engine.abort_request(rid)

        @invariant()
        def frontier_is_sound(self):
            for rid in self.sessions:
                view = self.engine.get_session(rid)
                assert 0 <= view.num_computed_tokens <= len(view.token_ids)
                assert len(view.block_ids) * 4 >= view.num_computed_tokens

        @invariant()
        def steps_are_bounded_by_work(self):
            assert self.engine.num_steps <= self._step_bound(), (
                f"{self.engine.num_steps} steps for {self.work} tokens of work: "
                f"{self.engine.scheduler.num_preemptions} preemptions, "
                f"{self.engine.num_recomputed_tokens} tokens recomputed"
            )

        def teardown(self):
            while self.engine.has_unfinished_requests():
                self._handle(self.engine.step())
                self.steps_are_bounded_by_work()
            for rid in self.sessions:
                view = self.engine.get_session(rid)
                assert view.status == "PAUSED" and not view.generating
                ref = hf_last_logits(hf, list(view.token_ids))
                torch.testing.assert_close(self.engine.get_logits(rid), ref, atol=1e-4, rtol=0)
                self.engine.close(rid)
                self.checked += 1
            assert self.engine.kv_pool_all_free
            totals["checked"] += self.checked
            totals["hits"] += self.engine.stats.prefix_cache_hits

    totals = {"checked": 0, "hits": 0}
    Sessions.TestCase.settings = settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    Sessions.TestCase().runTest()
    assert totals["checked"] >= EXAMPLES  # logits were really compared, about one per example
    assert totals["hits"] > 0  # and some of them after prefix-cache hits
