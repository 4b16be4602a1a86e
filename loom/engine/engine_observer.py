"""`EngineObserver`: generation counted at the engine's output side (exported by `GET /metrics`).

Every request's tokens pass the engine whatever route asked for them (completions, chat,
Responses, sessions, offline): a sequence hook sees each sampled token, and the sequence
table's lifecycle says when a segment or request ends. From these come tokens, finished
requests by reason, time to first token, end-to-end latency, inter-token latency and
per-request sizes, under vLLM's semantics: a session's segment is a request of its own.

Times are on the engine's clock (`SequenceTable.clock`), which also stamps when a segment
started (`SequenceState.segment_started`: a request added, a session's segment begun):

    segment_started ........ first token ... later tokens ... last token ... end
    |<-- time to first token -->|                                            |
    |<------------------------------ end-to-end latency -------------------->|

Concurrency: the observer runs on the engine's step thread or under the async engine's lock
(one writer at a time) and keeps plain counts that a scrape copies.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from loom.engine.hooks import HookContext, SequenceHook
from loom.engine.llm_engine import LLMEngine
from loom.engine.sequence import SequenceState

# finished_reason values of `vllm:request_success_total` exported from the start, as vLLM's.
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")
# How a request that ended as a group ended -> its finished_reason.
_GROUP_END_REASONS = {"aborted": "abort", "closed": "abort", "expired": "abort",
                      "failed": "error"}

# vLLM's bucket lists (seconds), with two finer inter-token buckets for fast small models.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TPOT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclass(frozen=True)
class Histogram:
    """A histogram's counts at one moment: per bound (Prometheus' `le`), then above every
    bound; and the sum of the values. Plain data: it crosses processes (a replica's reading)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    def cumulative(self) -> list[tuple[float, int]]:
        """(bound, values at most that), the last bound +inf."""
        running, out = 0, []
        for bound, count in zip([*self.bounds, float("inf")], self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


def token_buckets(max_value: int) -> list[float]:
    """vLLM's 1-2-5 buckets (1, 2, 5, 10, 20, 50, ...) up to `max_value` inclusive (the
    bounds of the per-request token histograms)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets or [1.0]
            buckets.append(float(value))
        exponent += 1


class Buckets:
    """A histogram as plain counts: an observation is a bisect and two additions (cheap on
    the engine's step thread)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one value (Prometheus' `le`: the first bound >= value)."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def histogram(self) -> Histogram:
        """The counts so far, copied."""
        return Histogram(self.bounds, tuple(self.counts), self.sum)


@dataclass(frozen=True)
class ObservedGeneration:
    """An `EngineObserver`'s counts at one moment (see its docstring for what each counts)."""

    prompt_tokens: int
    generation_tokens: int
    finished: dict[str, int]
    ttft: Histogram
    e2e: Histogram
    itl: Histogram
    tpot: Histogram
    decode_time: Histogram
    request_prompt: Histogram
    request_generation: Histogram


@dataclass
class _Segment:
    """A sequence's generation segment under way (a plain request has one; a session one per
    `resume`): when it started and its tokens came, how many, after how long a context."""

    seq: SequenceState
    prompt_tokens: int
    max_tokens: int | None  # the segment's (a later `resume` replaces the sequence's params)
    started: float
    first: float
    last: float
    step: int  # the engine step of its last token
    tokens: int = 1


class EngineObserver(SequenceHook):
    """Counts generation at the engine's output side, whatever route asked for it: every
    sampled token passes `on_token` (a hook, the engine's last), and a segment ends where the
    sequence table says (a plain sequence finishes, a session parks, a request ends).

    vLLM's semantics: prompt tokens count when a segment's first token comes (a session's
    segment continues after its whole context, as a client resending the conversation
    would), generated tokens as they come, and each finished sequence once by its reason.
    The tokens of a request tree's children count; the children are not requests."""

    def __init__(self, engine: LLMEngine, token_bins: Sequence[float] | None = None) -> None:
        if token_bins is None:
            token_bins = token_buckets(engine.config.max_model_len)
        self.engine = engine
        self.table = engine.table
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Buckets(TTFT_BUCKETS)
        self.e2e = Buckets(E2E_BUCKETS)
        self.itl = Buckets(TPOT_BUCKETS)
        self.tpot = Buckets(TPOT_BUCKETS)
        self.decode_time = Buckets(E2E_BUCKETS)
        self.request_prompt = Buckets(token_bins)
        self.request_generation = Buckets(token_bins)
        self._segments: dict[str, _Segment] = {}  # by sequence id, while under way
        engine.hooks.append(self)
        self.table.on_session_paused.append(self._on_paused)
        self.table.on_group_ended.append(self._on_group_ended)

    def counts(self) -> ObservedGeneration:
        """What was observed so far, copied (a scrape reads it while steps run: each
        histogram is copied whole, one at a time)."""
        return ObservedGeneration(
            self.prompt_tokens, self.generation_tokens, dict(self.finished),
            self.ttft.histogram(), self.e2e.histogram(), self.itl.histogram(),
            self.tpot.histogram(), self.decode_time.histogram(),
            self.request_prompt.histogram(), self.request_generation.histogram())

    def clock(self) -> float:
        """Now, on the engine's clock (the one that stamps segments' starts)."""
        return self.table.clock()

    def detach(self) -> None:
        """Stop observing the engine (its server is gone)."""
        for listeners, fn in ((self.engine.hooks, self),
                              (self.table.on_session_paused, self._on_paused),
                              (self.table.on_group_ended, self._on_group_ended)):
            if fn in listeners:
                listeners.remove(fn)

    def on_token(self, ctx: HookContext, seq_id: str, token_id: int) -> None:
        """A sampled token (called before it joins `segment_token_ids`)."""
        self.generation_tokens += 1
        segment = self._segments.get(seq_id)
        if segment is not None and segment.seq.segment_token_ids:  # a later token
            now, step = self.clock(), self.engine.num_steps
            if step != segment.step:  # vLLM's inter-token interval: once per step
                self.itl.observe(now - segment.last)
                segment.step = step
            segment.last = now
            segment.tokens += 1
            return
        seq = self.table.get(seq_id)
        if seq is None or seq.parent_id is not None:
            return
        if segment is not None:  # resumed before the last segment parked: it ended
            self._settle(seq_id, _cut_short_reason(segment), segment.last)
        now = self.clock()
        # Every token before this first one of the segment is its prompt.
        prompt = seq.request.num_tokens - 1
        self.prompt_tokens += prompt
        self.ttft.observe(max(now - seq.segment_started, 0.0))
        self._segments[seq_id] = _Segment(seq, prompt, seq.params.max_tokens,
                                          seq.segment_started, now, now, self.engine.num_steps)

    def on_finished(self, ctx: HookContext, seq_id: str) -> None:
        """A plain sequence finished (its reason is set)."""
        segment = self._segments.get(seq_id)
        if segment is not None:
            self._settle(seq_id, segment.seq.finish_reason, self.clock())

    def _on_paused(self, seq: SequenceState) -> None:
        """A session parked: a segment under way has ended (its reason is set) with its last
        token (parking computed the pending token after it)."""
        segment = self._segments.get(seq.request_id)
        if segment is not None:
            self._settle(seq.request_id, seq.finish_reason, segment.last)

    def _on_group_ended(self, request_id: str, reason: str, was_session: bool) -> None:
        """A request or session ended: its segments under way end with it, now; a request
        that ended before any token (aborted, failed) counts once."""
        ended = [sid for sid, s in self._segments.items() if s.seq.group_id == request_id]
        now = self.clock()
        for seq_id in ended:
            own = self._segments[seq_id].seq.finish_reason
            self._settle(seq_id, own if own is not None else _GROUP_END_REASONS.get(reason),
                         now)
        if not ended and not was_session and reason in _GROUP_END_REASONS:
            self._count_finished(_GROUP_END_REASONS[reason])

    def _settle(self, seq_id: str, reason: str | None, end: float) -> None:
        """Record a segment that ended at time `end`, once."""
        segment = self._segments.pop(seq_id)
        self._count_finished(reason or "stop")
        self.e2e.observe(max(end - segment.started, 0.0))
        self.request_prompt.observe(segment.prompt_tokens)
        self.request_generation.observe(segment.tokens)
        decode = segment.last - segment.first
        self.decode_time.observe(decode)
        if segment.tokens > 1:
            self.tpot.observe(decode / (segment.tokens - 1))

    def _count_finished(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1


def _cut_short_reason(segment: _Segment) -> str:
    """The reason of a session segment whose end the observer missed (a `resume` before the
    session parked: the new segment reset the sequence's reason): it reached max_tokens, or
    it stopped."""
    limit = segment.max_tokens
    return "length" if limit is not None and segment.tokens >= limit else "stop"
