"""`Scheduler`: one rule for prefill, chunked prefill, decode, appends and recompute.

Each step every runnable request is offered its uncomputed tokens, from its frontier up to
`Request.computable_end` (the end of its tokens, or the next range of K/V loaded from an
external store), out of a shared token budget: requests with a single uncomputed token
(decodes) first, then longer ranges (prefills, appended fragments, recomputation after
preemption, gaps in external K/V), chunked by what is left of the budget. With a time budget
(`max_step_ms`) the same rule holds with a second limit: a range gets the tokens the step's
predicted time has room for (`loom.core.step_cost`), so running streams are not held up by a
newcomer's long prompt. Nothing here knows whether tokens came from a prompt, a sampler or a
caller's append.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass

from loom.core.external_kv import ExternalKV
from loom.core.kv_cache_manager import KVCacheManager, cdiv
from loom.core.kv_transfer import SchedulerConnector
from loom.core.request import Request, RequestStatus
from loom.core.scheduler_output import ScheduledChunk, SchedulerOutput, Unschedulable
from loom.core.step_cost import LinearStepCost, StepCost

logger = logging.getLogger("loom")
# Share of a step's time budget that prefill ranges get even when decodes fill the rest.
RANGE_SHARE = 0.25
# The budget in effect is at least this multiple of the model's fixed cost per step.
FIXED_COST_MULTIPLE = 2.0


@dataclass
class _StepClock:
    """A step's time budget as chunks are added (ms): what is left of it, what is still
    reserved for ranges, and the best (lowest) priority among the step's decodes."""

    left: float
    reserved: float
    best_decode_priority: float = math.inf


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step and of the KV pool."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    num_kv_blocks: int = 1024
    block_size: int = 16
    enable_prefix_caching: bool = True
    # A time budget per step (None: tokens alone bound a step): prefill chunks are sized so
    # the step's predicted cost (`loom.core.step_cost`) stays within it, after the decodes.
    max_step_ms: float | None = None


class Scheduler:
    """Holds every unfinished request in exactly one place:

    - `waiting`: no blocks; new requests and preempted running ones (FIFO, preempted first)
    - `running`: hold blocks and have work, or are generating
    - `idle`: hold blocks (or were preempted while idle) and have nothing to do: paused
      sessions and blocked parents. They become runnable again through `wake`.
    """

    def __init__(
        self, config: SchedulerConfig, connector: SchedulerConnector | None = None,
        cost: StepCost | None = None,
    ) -> None:
        self.config = config
        self.connector = connector
        # What a step costs (fed by the engine's measured steps): with max_step_ms it sizes
        # the prefill chunks.
        self.cost: StepCost | None = cost if cost is not None else (
            LinearStepCost() if config.max_step_ms is not None else None)
        self._warned_tiny_budget = False
        self.kv = KVCacheManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.idle: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.num_recomputed_tokens = 0
        self.num_computed_tokens = 0  # every position the model computed, drafts included
        self.num_preemptions = 0
        self.external = ExternalKV(connector, self.kv) if connector is not None else None

    # ---- membership -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request."""
        request.status = RequestStatus.WAITING
        request.last_used = time.monotonic()
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_work(self) -> bool:
        """True when a step could schedule something."""
        return bool(self.waiting) or bool(self.running)

    def finish(self, request_id: str, status: RequestStatus) -> Request:
        """Remove a request wherever it is, free its blocks and set its terminal status."""
        request = self.requests.pop(request_id)
        self._detach(request)
        self.kv.cache_blocks(request, request.num_computed_tokens)
        if self.external is not None:
            self.external.request_finished(request, self.kv.block_ids(request_id))
        self.kv.free(request_id)
        request.status = status
        return request

    def _detach(self, request: Request) -> None:
        if self.idle.pop(request.request_id, None) is not None:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def park(self, request: Request, status: RequestStatus) -> None:
        """Move a request to `idle` (PAUSED or BLOCKED), keeping its blocks."""
        self._detach(request)
        request.status = status
        request.last_used = time.monotonic()
        self.idle[request.request_id] = request

    def wake(self, request: Request) -> None:
        """Make an idle request runnable again: it keeps its blocks if it still has them."""
        if self.idle.pop(request.request_id, None) is None:
            return
        request.last_used = time.monotonic()
        if self.kv.holds_blocks(request.request_id) or request.num_computed_tokens > 0:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        else:
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block hash; returns how many were dropped."""
        return self.kv.reset_prefix_cache()

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Drop tokens past `num_tokens` and the blocks that no longer hold any of them."""
        request.truncate(num_tokens)
        self.kv.truncate(request.request_id, num_tokens)

    # ---- the step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks under the token budget and, with `max_step_ms`, the time
        budget: decodes first (their cost comes off the time budget but never stops them),
        then longer ranges, each cut to the tokens the time left allows; preempting when
        blocks run out. Among ranges and waiting requests, lower `priority` goes first, then
        the order of arrival."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        clock = self._clock()

        def is_decode(r: Request) -> bool:
            return r.num_uncomputed_tokens - r.num_draft_tokens == 1

        queue = sorted(self.running, key=lambda r: (not is_decode(r), r.priority))
        for request in queue:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING or request.loading_kv:
                continue  # preempted earlier in this loop, or its K/V is being loaded
            limit = budget if is_decode(request) else self._time_limit(clock, request, budget,
                                                                          out)
            if limit == 0:
                break  # the time is spent: the remaining ranges wait for the next step
            num_new = self._reserve(request, limit, scheduled, out)
            if num_new == 0:
                continue  # nothing to do, or the request preempted itself
            out.chunks.append(self._chunk(request, num_new, out))
            self._spend(clock, out.chunks[-1])
            scheduled.add(request.request_id)
            budget -= num_new
            if request.ready_ranges:
                before = len(out.chunks)
                budget -= self._later_gaps(request, budget, out)
                for gap in out.chunks[before:]:
                    self._spend(clock, gap)

        if any(r.priority for r in self.waiting):  # stable: arrival order within a priority
            self.waiting = deque(sorted(self.waiting, key=lambda r: r.priority))
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            limit = self._time_limit(clock, request, budget, out)
            if limit == 0:
                break  # the time is spent: new requests wait, running streams do not
            num_new = self._admit(request, limit, out)
            if num_new is None:
                break  # FIFO: do not let later requests overtake the head
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if num_new == 0:
                continue  # admitted to load external K/V this step; computes from the next
            out.chunks.append(self._chunk(request, num_new, out))
            self._spend(clock, out.chunks[-1])
            scheduled.add(request.request_id)
            budget -= num_new

        # Drafts live only in scheduled chunks (preempted requests dropped theirs already).
        for request in self.running:
            if request.num_draft_tokens and request.request_id not in scheduled:
                request.discard_draft_tokens()
        out.block_copies = self.kv.take_pending_copies()
        if self.external is not None:
            self.external.fill_blocks(out, self.requests)
            self.external.build_meta(out)
        return out

    def _chunk(
        self, request: Request, num_new: int, out: SchedulerOutput, start: int | None = None
    ) -> ScheduledChunk:
        start = request.num_computed_tokens if start is None else start
        end = start + num_new
        out.num_recomputed_tokens += max(0, min(end, request.max_computed_tokens) - start)
        out.num_gap_tokens += max(0, min(end, request.external_end) - start)
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.token_ids[start:end],
            start_pos=start,
            block_ids=self.kv.block_ids(request.request_id),
            needs_logits=end == request.num_tokens and request.pooling is None,
            num_draft_tokens=request.num_draft_tokens,  # a chunk covers all drafts or none
            all_logits=request.wants_prompt_logits and start < request.num_prompt_tokens,
            pooling=request.pooling,
        )

    # ---- the time budget -------------------------------------------------------------

    def _clock(self) -> _StepClock | None:
        """The step's time (spent as chunks are added), or None without a time budget or
        before the cost model is calibrated. Ranges keep RANGE_SHARE of the budget whatever
        the decodes take: prefill progresses every step (a step then runs past the budget by
        at most that share), so a waiting prompt is never starved by streams that keep
        coming."""
        limit, cost = self.config.max_step_ms, self.cost
        if limit is None or cost is None or not cost.calibrated:
            return None
        # Never below twice a step's fixed cost: a model whose bare decode step takes most of
        # the budget would otherwise leave prefill a trickle (a 1.7B model on two cores:
        # 80 ms a step against 100).
        limit = max(limit, FIXED_COST_MULTIPLE * cost.fixed_ms())
        return _StepClock(left=limit - cost.fixed_ms(), reserved=RANGE_SHARE * limit)

    def _spend(self, clock: _StepClock | None, chunk: ScheduledChunk) -> None:
        if clock is not None and self.cost is not None:
            ms = self.cost.chunk_ms(len(chunk.token_ids), chunk.start_pos)
            clock.left -= ms
            if len(chunk.token_ids) - chunk.num_draft_tokens > 1:  # a range, not a decode
                clock.reserved -= ms
            else:
                clock.best_decode_priority = min(clock.best_decode_priority,
                                                 self.requests[chunk.request_id].priority)

    def _time_limit(self, clock: _StepClock | None, request: Request, budget: int,
                    out: SchedulerOutput) -> int:
        """The most tokens of `request`'s next range the time left allows (at most
        `budget`); at least one when the step would otherwise compute nothing, so that a
        budget too small for one token still makes progress (said once in the log)."""
        if clock is None or self.cost is None:
            return budget
        # A stream of better priority decoding in this step keeps its pace: a range of worse
        # priority gets only the share reserved for ranges (so it still progresses).
        if clock.best_decode_priority < request.priority:
            left = clock.reserved
        else:
            left = max(clock.left, clock.reserved)
        tokens = min(budget, self.cost.tokens_within(left, request.num_computed_tokens))
        if tokens <= 0 and not out.chunks:
            if not self._warned_tiny_budget:
                self._warned_tiny_budget = True
                logger.warning(
                    "max_step_ms=%s is too small for one token after a step's fixed cost "
                    "(%.1f ms predicted): steps compute one token each",
                    self.config.max_step_ms, self.cost.fixed_ms())
            return 1
        return max(tokens, 0)

    def _later_gaps(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """After a request's chunk reached a ready range, chunks for the gaps after its
        following ready ranges, in order, while the budget lasts; returns their tokens.

            tokens: [ frontier ... chunk | ready | gap | ready | gap |  rest ...  ]
                                                 ^ 2nd ^       ^ 3rd ^ (new blocks)

        Only tokens in blocks the request already holds (allocated when its K/V was
        matched) are taken; each chunk's K/V is written before any token of the step
        attends, so a later gap reads an earlier one's.
        """
        used, end = 0, out.chunks[-1].end_pos
        held = min(request.num_tokens,
                   len(self.kv.block_ids(request.request_id)) * self.config.block_size)
        ranges = request.ready_ranges
        for i, (start, gap_start) in enumerate(ranges):
            if start != end or used == budget:
                break
            gap_end = ranges[i + 1][0] if i + 1 < len(ranges) else held
            num_new = min(gap_end - gap_start, budget - used)
            if num_new <= 0:
                break
            out.chunks.append(self._chunk(request, num_new, out, gap_start))
            used += num_new
            end = gap_start + num_new
        return used

    def _reserve(
        self, request: Request, budget: int, scheduled: set[str], out: SchedulerOutput
    ) -> int:
        """Allocate blocks for the request's next chunk, at most `budget` tokens, preempting
        others until it fits; returns the chunk's length (0: it preempted itself).

        Drafts are optional work: those the budget cannot take whole are dropped, and all of
        them are dropped rather than preempting anyone for their blocks."""
        excess = request.num_uncomputed_tokens - budget
        if excess > 0:
            request.discard_draft_tokens(excess)
        cached = self.kv.find_cached_blocks(request)
        num_new = self._chunk_length(request, cached, budget)
        while not self._allocate(request, num_new, cached):
            if request.num_draft_tokens:
                num_new -= request.num_draft_tokens
                request.discard_draft_tokens()
                continue
            if not self._can_ever_fit(request, num_new, cached, out):
                return 0  # preempting anyone (itself included) would only repeat forever
            victim = self._pick_victim(request, scheduled)
            self._preempt(victim, out)
            if victim is request:
                return 0
        return num_new

    def _admit(self, request: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Allocate for the waiting request's first chunk, evicting idle sessions and newer
        waiting requests' blocks (never running requests); returns its length, 0 when it was
        admitted to load external K/V first, None when it cannot start now.

        The local prefix cache is asked first, the connector's store for what follows."""
        cached = self.kv.find_cached_blocks(request)
        num_external = 0
        if self.external is not None:
            num_external = self.external.match(
                request, self._start_after(request, cached),
                len(self.kv.block_ids(request.request_id)) + len(cached),
            )
        num_new = num_external or self._chunk_length(request, cached, budget)
        if num_new <= 0:
            return None
        if not self._allocate(request, num_new, cached):
            if not self._can_ever_fit(request, num_new, cached, out):
                return None
            while not self._allocate(request, num_new, cached):
                victim = self._idle_victim() or self._waiting_victim(request)
                if victim is None:
                    return None
                self._preempt(victim, out)
        if num_external:
            assert self.external is not None
            self.external.start_load(request, num_external, out)
            return 0
        return num_new

    def _start_after(self, request: Request, cached: list[int]) -> int:
        """Where the next chunk starts: the frontier, past the cached blocks found for it."""
        return request.num_computed_tokens + len(cached) * self.config.block_size

    def _chunk_length(self, request: Request, cached: list[int], budget: int) -> int:
        """Tokens the next chunk computes: those after the cached blocks up to the next
        ready range (or the end), within the budget."""
        return min(request.computable_end - self._start_after(request, cached), budget)

    def _allocate(self, request: Request, num_new: int, cached: list[int]) -> bool:
        """Take the cached blocks and blocks for `num_new` tokens after them, all or nothing;
        on success the frontier moves past the cached blocks (their K/V is already there)."""
        start = self._start_after(request, cached)
        if not self.kv.allocate_slots(request.request_id, start + num_new, cached, start):
            return False
        self.kv.count_query(request)
        if cached:
            request.num_cached_tokens += start - request.num_computed_tokens
            request.advance_frontier(start)
        return True

    def _can_ever_fit(
        self, request: Request, num_new: int, cached: list[int], out: SchedulerOutput
    ) -> bool:
        """Whether the request could ever hold the slots of its next `num_new` tokens after
        the `cached` blocks; if not, report it in `out.unschedulable` for the engine to fail.

        Every block can be freed for it by preemption or eviction except those of pinned idle
        sessions (blocks it shares with them are already its own). Without this check a
        request needing more than the rest of the pool preempts itself, recomputes and
        preempts itself again forever.
        """
        pinned: set[int] = set()
        for idle in self.idle.values():
            if idle.pinned:
                pinned.update(self.kv.block_ids(idle.request_id))
        own = [*self.kv.block_ids(request.request_id), *cached]
        num_tokens = self._start_after(request, cached) + num_new
        needed = cdiv(num_tokens, self.config.block_size) - len(pinned.intersection(own))
        available = self.config.num_kv_blocks - len(pinned)
        if needed <= available:
            return True
        out.unschedulable.append(Unschedulable(request.request_id, needed, available))
        return False

    def _idle_victim(self) -> Request | None:
        """The least recently used unpinned idle request that holds blocks."""
        idle = [
            r for r in self.idle.values() if not r.pinned and self.kv.holds_blocks(r.request_id)
        ]
        return min(idle, key=lambda r: r.last_used) if idle else None

    def _waiting_victim(self, request: Request) -> Request | None:
        """The newest waiting request, arrived after `request`, that holds blocks (a forked
        child not started yet): it must not keep an older request from ever fitting."""
        holders = [
            r for r in self.waiting
            if r is not request and r.arrival_order > request.arrival_order
            and self.kv.holds_blocks(r.request_id)
        ]
        return max(holders, key=lambda r: r.arrival_order) if holders else None

    def _pick_victim(self, request: Request, scheduled: set[str]) -> Request:
        """Idle sessions first (least recently used, unpinned), then newer waiting requests
        that hold blocks, then the newest running one (possibly `request` itself)."""
        victim = self._idle_victim() or self._waiting_victim(request)
        if victim is not None:
            return victim
        candidates = [r for r in self.running if r.request_id not in scheduled]
        return max(candidates, key=lambda r: r.arrival_order) if candidates else request

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Drop the victim's K/V; it recomputes everything when scheduled again."""
        victim.discard_draft_tokens()
        victim.drop_external_kv()
        self.kv.cache_blocks(victim, victim.num_computed_tokens)
        self.kv.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.num_cache_queried_tokens = 0
        self.num_preemptions += 1
        out.preempted_request_ids.append(victim.request_id)
        if victim.request_id in self.idle:
            return  # stays idle (status unchanged); `wake` sends it to `waiting`
        if victim not in self.running:
            return  # a waiting request keeps its place in the queue, now without blocks
        self.running.remove(victim)
        victim.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(victim)

    def update_after_step(
        self, out: SchedulerOutput, load_errors: dict[int, str] | None = None,
        load_failure: str | None = None,
    ) -> None:
        """Advance the frontier of every scheduled request by its chunk length, and settle
        this step's external loads (`load_errors`: block id -> why its load failed;
        `load_failure`: why the whole load failed, e.g. the connector raised, so every block
        it was to load failed; a load that failed while being planned,
        `out.failed_load_plans`, fails whole for its own reason)."""
        self.num_recomputed_tokens += out.num_recomputed_tokens
        self.num_computed_tokens += sum(len(chunk.token_ids) for chunk in out.chunks)
        if self.external is not None:
            self.external.num_gap_tokens += out.num_gap_tokens
        for request_id in out.loading_request_ids:
            request = self.requests.get(request_id)
            if request is not None and request.loading_kv and self.external is not None:
                failure = out.failed_load_plans.get(request_id, load_failure)
                self.external.finish_load(request, load_errors or {}, out, failure)
        for chunk in out.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None:
                continue
            request.advance_frontier(chunk.end_pos)
            # Drafts are hashed only once verified: the next step's frontier covers them.
            self.kv.cache_blocks(request, chunk.end_pos - chunk.num_draft_tokens)
