"""Randomized sessions and plain requests on a small block pool (hypothesis, stateful).

Many sessions and plain requests go through random operations: open, prefill (with or
without a new segment), resume, rewind, step, close, abort. At the end every session's
stored logits equal a fresh forward pass over its tokens, and closing everything leaves the
pool fully free.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from engine.helpers import make_engine, run_to_completion
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

        def _new_id(self, kind):
            self.counter += 1
            return f"{kind}{self.counter}"

        @rule(prompt=TOKENS, params=st.one_of(st.none(), GEN), pin=st.booleans())
        def open_session(self, prompt, params, pin):
            rid = self._new_id("s")
            self.engine.add_request(rid, prompt, params, session=True, pin=pin)
            self.sessions.append(rid)

        @rule(prompt=TOKENS, n=st.integers(1, 6))
        def add_plain(self, prompt, n):
            rid = self._new_id("p")
            self.engine.add_request(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True))
            self.plain.append(rid)

        @precondition(lambda self: self.sessions)
        @rule(data=st.data(), fragment=TOKENS, params=st.one_of(st.none(), GEN))
        def prefill(self, data, fragment, params):
            rid = data.draw(st.sampled_from(self.sessions))
            before = self.engine.get_session(rid)
            try:
                self.engine.prefill(rid, fragment, params)
            except PromptTooLongError:
                assert self.engine.get_session(rid) == before

        @precondition(lambda self: self.sessions)
        @rule(data=st.data(), params=GEN)
        def resume(self, data, params):
            rid = data.draw(st.sampled_from(self.sessions))
            with contextlib.suppress(InvalidSessionStateError, PromptTooLongError):
                self.engine.resume(rid, params)

        @precondition(lambda self: self.sessions)
        @rule(data=st.data(), k=st.integers(1, 6))
        def rewind(self, data, k):
            rid = data.draw(st.sampled_from(self.sessions))
            view = self.engine.get_session(rid)
            if view.generating or k >= len(view.token_ids):
                return
            self.engine.rewind(rid, k)

        @rule(n=st.integers(1, 4))
        def step(self, n):
            for _ in range(n):
                for out in self.engine.step():
                    if out.error is not None:  # pool held by pinned sessions: it was failed
                        assert "cannot be scheduled" in out.error
                        self._forget(out.request_id)

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
            if rid in self.engine._groups:
                self.engine.abort_request(rid)

        @invariant()
        def frontier_is_sound(self):
            for rid in self.sessions:
                view = self.engine.get_session(rid)
                assert 0 <= view.num_computed_tokens <= len(view.token_ids)
                assert len(view.block_ids) * 4 >= view.num_computed_tokens

        def teardown(self):
            for out in run_to_completion(self.engine).values():
                if out.error is not None:
                    self._forget(out.request_id)
            for rid in self.sessions:
                view = self.engine.get_session(rid)
                assert view.status == "PAUSED" and not view.generating
                ref = hf_last_logits(hf, list(view.token_ids))
                torch.testing.assert_close(self.engine.get_logits(rid), ref, atol=1e-4, rtol=0)
                self.engine.close(rid)
            assert self.engine.kv_pool_all_free

    Sessions.TestCase.settings = settings(
        max_examples=15, stateful_step_count=20, deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    Sessions.TestCase().runTest()
