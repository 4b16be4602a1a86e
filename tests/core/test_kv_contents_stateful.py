"""The KV a request reads is always the KV of its own tokens (hypothesis, stateful, no model).

A fake runner writes, into each slot a chunk computes, a label naming what the real K/V of
that position depends on: the tokens up to and including it. Requests share a three-token
alphabet, so prefixes repeat and the prefix cache, forks, copy-on-write, rewinds and
preemption all happen on a small pool. A fake external store (a KV connector) saves the
blocks steps fill, loses some, and fails some loads, so loads with gaps happen too. After
every operation, every computed position of every request must read the label of its own
tokens through its block table.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loom.core.request import Request, RequestStatus
from loom.core.scheduler import Scheduler, SchedulerConfig

BLOCK = 4
TOKENS = st.lists(st.integers(1, 3), min_size=1, max_size=14)


class FakeStore:
    """A KV connector over a dict: block key -> the labels of its slots. It matches up to the
    last stored full block (the missing ones before it are gaps), like StoreConnector."""

    load_failure_policy = "recompute"

    def __init__(self) -> None:
        self.blocks: dict[bytes, tuple] = {}
        self.matches: dict[str, tuple[dict[int, bytes], list]] = {}
        self.loads: list[tuple[int, bytes]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        first, last = num_computed_tokens // BLOCK, (request.num_tokens - 1) // BLOCK
        keys = request.block_keys(BLOCK, last)
        found = [i for i in range(first, last) if keys[i] in self.blocks]
        if not found:
            return 0, False
        end = found[-1] + 1
        gaps = [(i * BLOCK, (i + 1) * BLOCK) for i in range(first, end) if i not in found]
        self.matches[request.request_id] = ({i: keys[i] for i in found}, gaps)
        return end * BLOCK - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        keys, _ = self.matches[request.request_id]
        self.loads += [(blocks[i], key) for i, key in keys.items()]

    def get_computed_token_gaps(self, request):
        return self.matches[request.request_id][1]

    def build_connector_meta(self, scheduler_output):
        loads, self.loads = self.loads, []
        saves = [(b.block_id, b.block_hash) for b in scheduler_output.filled_blocks]
        return loads, saves

    def request_finished(self, request, block_ids):
        self.matches.pop(request.request_id, None)
        return False, None


class KVContents(RuleBasedStateMachine):
    """Random requests on a 12-block pool, checked slot by slot."""

    def __init__(self) -> None:
        super().__init__()
        self.store = FakeStore()
        self.s = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=6,
                                           num_kv_blocks=12, block_size=BLOCK), self.store)
        self.slots: dict[int, tuple[int, ...]] = {}  # slot -> tokens its K/V depends on
        self.counter = 0

    def _ids(self, status: RequestStatus | None = None) -> list[str]:
        return sorted(rid for rid, r in self.s.requests.items()
                      if status is None or r.status == status)

    @rule(tokens=TOKENS)
    def add(self, tokens):
        self.counter += 1
        self.s.add_request(Request(f"r{self.counter}", list(tokens)))

    @rule(data=st.data())
    def step(self, data):
        out = self.s.schedule()
        self.slots = self._copied(self.slots, out.block_copies)  # before the forward
        loads, saves = out.kv_connector_metadata
        errors = {}
        for block_id, key in loads:  # a load fails now and then: it must be recomputed
            if data.draw(st.integers(0, 4)) == 0:
                errors[block_id] = "lost"
                continue
            for i, label in enumerate(self.store.blocks[key]):
                self.slots[block_id * BLOCK + i] = label
        for chunk in out.chunks:
            tokens = self.s.requests[chunk.request_id].token_ids
            for p in range(chunk.start_pos, chunk.end_pos):
                slot = chunk.block_ids[p // BLOCK] * BLOCK + p % BLOCK
                self.slots[slot] = tuple(tokens[: p + 1])
        for block_id, key in saves:  # after the forward
            self.store.blocks[key] = tuple(self.slots.get(block_id * BLOCK + i)
                                           for i in range(BLOCK))
        self.s.update_after_step(out, errors)
        for item in out.unschedulable:
            self.s.finish(item.request_id, RequestStatus.FINISHED_ERROR)
        for chunk in out.chunks:
            request = self.s.requests.get(chunk.request_id)
            if chunk.needs_logits and request is not None:
                request.append_tokens([data.draw(st.integers(1, 3))])

    @rule()
    def reset_prefix_cache(self):
        """Forget the local prefix cache: the store becomes the only source of old K/V."""
        self.s.reset_prefix_cache()

    @precondition(lambda self: self.store.blocks)
    @rule(data=st.data())
    def store_loses_a_block(self, data):
        """The external store evicts a block: later matches have a gap there."""
        del self.store.blocks[data.draw(st.sampled_from(sorted(self.store.blocks)))]

    @precondition(lambda self: self.s.requests)
    @rule(data=st.data())
    def finish(self, data):
        self.s.finish(data.draw(st.sampled_from(self._ids())), RequestStatus.FINISHED_STOPPED)

    @precondition(lambda self: self.s.requests)
    @rule(data=st.data())
    def fork(self, data):
        """A child sharing the parent's computed blocks (as `<promise>` does); the parent may
        itself be a child whose block copies have not run yet."""
        parent = self.s.requests[data.draw(st.sampled_from(self._ids()))]
        self.counter += 1
        child = Request(f"r{self.counter}", list(parent.token_ids),
                        num_computed_tokens=parent.num_computed_tokens,
                        max_computed_tokens=parent.num_computed_tokens)
        if self.s.kv.fork(parent.request_id, child.request_id, parent.num_computed_tokens):
            self.s.add_request(child)

    @staticmethod
    def _copied(slots, copies):
        """`slots` after the block copies, performed as the runner does: one gather (every
        source read before any destination is written)."""
        read = {(dst, i): slots.get(src * BLOCK + i) for src, dst in copies for i in range(BLOCK)}
        after = dict(slots)
        for (dst, i), label in read.items():
            after[dst * BLOCK + i] = label
        return after

    @precondition(lambda self: self.s.running)
    @rule(data=st.data(), fragment=st.lists(st.integers(1, 3), max_size=6),
          rewind=st.integers(0, 6))
    def pause_rewind_append(self, data, fragment, rewind):
        """A session pauses, optionally drops its last tokens, appends a fragment, wakes."""
        request = self.s.requests[data.draw(st.sampled_from(self._ids(RequestStatus.RUNNING)))]
        self.s.park(request, RequestStatus.PAUSED)
        keep = request.num_tokens - rewind
        if 0 < keep < request.num_tokens:
            self.s.truncate(request, keep)
            request.num_computed_tokens = min(request.num_computed_tokens, keep - 1)
        request.append_tokens(fragment)
        self.s.wake(request)

    @invariant()
    def every_computed_position_reads_its_own_tokens(self):
        # Copies queued since the last step (forks, copy-on-write) run before anything reads.
        slots = self._copied(self.slots, self.s.kv.pending_copies)
        for rid, request in self.s.requests.items():
            table = self.s.kv.block_ids(rid)
            assert len(table) * BLOCK >= request.num_computed_tokens
            for p in range(request.num_computed_tokens):
                slot = table[p // BLOCK] * BLOCK + p % BLOCK
                assert slots.get(slot) == tuple(request.token_ids[: p + 1]), (rid, p)

    def teardown(self):
        for rid in self._ids():
            self.s.finish(rid, RequestStatus.FINISHED_STOPPED)
        assert self.s.kv.pool.all_free


def test_kv_contents_follow_tokens_under_caching_forks_and_rewinds():
    KVContents.TestCase.settings = settings(
        max_examples=150, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    KVContents.TestCase().runTest()
