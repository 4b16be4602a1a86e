"""Prometheus metrics of `loom serve` (`GET /metrics`), under vLLM's names and labels.

A metric vLLM also exports has vLLM's name (`vllm:`), type and labels (`model_name` and
`engine`), so dashboards, llm-d's scorers and the production-stack router read Loom as they
read vLLM; the router's older names (`vllm:gpu_cache_usage_perc`, `vllm:gpu_prefix_cache_*`)
are exported beside the current ones. What only Loom has (paused and blocked sessions,
queued prompt tokens, KV blocks, recomputed tokens, step times, the KV connector's
counters) is under `loom:`. One registry per `ServerMetrics` (never the global one, so
several servers or tests in one process do not collide). Three sources:

- engine state, read at scrape time by a custom collector (`EngineCollector`): request
  counts by place in the scheduler, the KV pool, and the engine's own counters. Nothing is
  cached, so nothing is stale, and no thread updates anything between scrapes.
- generation, counted where every request's tokens pass whatever route asked for them
  (completions, chat, Responses, sessions, offline): `EngineObserver`, a sequence hook that
  sees each sampled token, and the sequence table's lifecycle, which says when a segment or
  request ends. Tokens, finished requests by reason, inter-token latency, per-request sizes.
- latencies that start at a request's arrival at the server (time to first token,
  end-to-end), which only its route knows: a `RequestTimer` per request.

Concurrency: the observer runs on the engine's step thread or under the async engine's
lock (one writer at a time) and keeps plain counts a scrape copies; timers record on the
event loop. A scrape reads the engine WITHOUT the async engine's lock, possibly while a step
runs in its worker thread: `read_engine` only takes `len()` of the scheduler's containers,
copies the idle dict in one C-level call (`list(dict.values())`, atomic under the GIL;
retried should a free-threaded build see the dict resized) and reads integer attributes.
The numbers of one scrape may therefore mix before and after a step (a request counted
neither running nor waiting for an instant); every value is clamped to its range, and a
scrape never raises on account of a step.
"""

from __future__ import annotations

import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from loom.engine.hooks import HookContext, SequenceHook
from loom.engine.llm_engine import LLMEngine
from loom.engine.sequence import SequenceState
from loom.engine.stats import EngineStats

VLLM, LOOM = "vllm:", "loom:"
# vLLM's labels on every metric: the served model, and the engine's index (one engine here).
LABELS: tuple[str, ...] = ("model_name", "engine")
ENGINE_INDEX = "0"
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


def token_buckets(max_value: int) -> list[float]:
    """vLLM's 1-2-5 buckets (1, 2, 5, 10, 20, 50, ...) up to `max_value` inclusive."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets or [1.0]
            buckets.append(float(value))
        exponent += 1


@dataclass(frozen=True)
class EngineSnapshot:
    """What one scrape reads from the engine (sequence counts, not caller request ids)."""

    num_running: int
    num_waiting: int
    num_paused: int
    num_blocked: int
    stats: EngineStats
    # Prompt, fragment and recompute tokens not computed yet (waiting and running ranges).
    num_queued_prompt_tokens: int = 0
    # (upper bound ms, steps at most that long), cumulative; the sum of the steps' ms.
    step_time_buckets: tuple[tuple[float, int], ...] = ()
    step_time_sum_ms: float = 0.0


def read_engine(engine: LLMEngine) -> EngineSnapshot:
    """Read the engine's gauges and counters through its API, without its lock (see the
    module docstring)."""
    load, steps = engine.load, engine.step_times
    return EngineSnapshot(
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        num_paused=load.num_paused,
        num_blocked=load.num_blocked,
        stats=engine.stats,
        num_queued_prompt_tokens=load.num_queued_prompt_tokens,
        step_time_buckets=tuple(steps.cumulative()),
        step_time_sum_ms=steps.sum_ms,
    )


_NO_ENGINE = EngineSnapshot(0, 0, 0, 0, EngineStats(**{f.name: 0 for f in fields(EngineStats)}))


class Buckets:
    """A histogram as plain counts: an observation is a bisect and two additions (cheap on
    the engine's step thread); exported as a family at scrape time."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one value (Prometheus' `le`: the first bound >= value)."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
        """The cumulative exposition of the counts so far."""
        counts, total, running = list(self.counts), self.sum, 0
        buckets = []
        for bound, count in zip([*map(floatToGoString, self.bounds), "+Inf"], counts,
                                strict=True):
            running += count
            buckets.append((bound, running))
        family = HistogramMetricFamily(name, doc, labels=list(LABELS))
        family.add_metric(labels, buckets, total)
        return family


@dataclass
class _Segment:
    """A sequence's generation segment under way (a plain request has one; a session one per
    `resume`): when its tokens came, how many, after how long a context."""

    seq: SequenceState
    prompt_tokens: int
    max_tokens: int | None  # the segment's (a later `resume` replaces the sequence's params)
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

    def __init__(self, engine: LLMEngine, clock: Callable[[], float],
                 token_bins: Sequence[float]) -> None:
        self.engine = engine
        self.table = engine.table
        self.clock = clock
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self.itl = Buckets(TPOT_BUCKETS)
        self.tpot = Buckets(TPOT_BUCKETS)
        self.decode_time = Buckets(E2E_BUCKETS)
        self.request_prompt = Buckets(token_bins)
        self.request_generation = Buckets(token_bins)
        self._segments: dict[str, _Segment] = {}  # by sequence id, while under way
        engine.hooks.append(self)
        self.table.on_session_paused.append(self._on_paused)
        self.table.on_group_ended.append(self._on_group_ended)

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
            self._settle(seq_id, _cut_short_reason(segment))
        now = self.clock()
        # Every token before this first one of the segment is its prompt.
        prompt = seq.request.num_tokens - 1
        self.prompt_tokens += prompt
        self._segments[seq_id] = _Segment(seq, prompt, seq.params.max_tokens, now, now,
                                          self.engine.num_steps)

    def on_finished(self, ctx: HookContext, seq_id: str) -> None:
        """A plain sequence finished (its reason is set)."""
        segment = self._segments.get(seq_id)
        if segment is not None:
            self._settle(seq_id, segment.seq.finish_reason)

    def _on_paused(self, seq: SequenceState) -> None:
        """A session parked: a segment under way has ended (its reason is set)."""
        if seq.request_id in self._segments:
            self._settle(seq.request_id, seq.finish_reason)

    def _on_group_ended(self, request_id: str, reason: str, was_session: bool) -> None:
        """A request or session ended: its segments under way end with it; a request that
        ended before any token (aborted, failed) counts once."""
        ended = [sid for sid, s in self._segments.items() if s.seq.group_id == request_id]
        for seq_id in ended:
            own = self._segments[seq_id].seq.finish_reason
            self._settle(seq_id, own if own is not None else _GROUP_END_REASONS.get(reason))
        if not ended and not was_session and reason in _GROUP_END_REASONS:
            self._count_finished(_GROUP_END_REASONS[reason])

    def _settle(self, seq_id: str, reason: str | None) -> None:
        """Record a segment that ended, once."""
        segment = self._segments.pop(seq_id)
        self._count_finished(reason or "stop")
        self.request_prompt.observe(segment.prompt_tokens)
        self.request_generation.observe(segment.tokens)
        decode = segment.last - segment.first
        self.decode_time.observe(decode)
        if segment.tokens > 1:
            self.tpot.observe(decode / (segment.tokens - 1))

    def _count_finished(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def families(self, labels: list[str]) -> list[Metric]:
        """The observer's counters and histograms, as of now."""
        out: list[Metric] = []
        for name, doc, value in (
                ("prompt_tokens", "Prompt tokens of the segments that produced a token.",
                 self.prompt_tokens),
                ("generation_tokens", "Generated tokens.", self.generation_tokens)):
            family = CounterMetricFamily(VLLM + name, doc, labels=list(LABELS))
            family.add_metric(labels, value)
            out.append(family)
        success = CounterMetricFamily(VLLM + "request_success", "Finished requests by reason.",
                                      labels=[*LABELS, "finished_reason"])
        for reason, count in list(self.finished.items()):
            success.add_metric([*labels, reason], count)
        out.append(success)
        for buckets, name, doc in (
                (self.itl, "inter_token_latency_seconds", "Time between a request's tokens."),
                (self.tpot, "request_time_per_output_token_seconds",
                 "Per request: (last - first token time) / (generated tokens - 1)."),
                (self.decode_time, "request_decode_time_seconds",
                 "Per request: time from its first token to its last."),
                (self.request_prompt, "request_prompt_tokens", "Prompt tokens per request."),
                (self.request_generation, "request_generation_tokens",
                 "Generated tokens per request.")):
            out.append(buckets.family(VLLM + name, doc, labels))
        return out


def _cut_short_reason(segment: _Segment) -> str:
    """The reason of a session segment whose end the observer missed (a `resume` before the
    session parked: the new segment reset the sequence's reason): it reached max_tokens, or
    it stopped."""
    limit = segment.max_tokens
    return "length" if limit is not None and segment.tokens >= limit else "stop"


class EngineCollector(Collector):
    """Exports the engine's state at scrape time, and the observer's counts; optional groups
    follow the engine's config."""

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        read: Callable[[LLMEngine], EngineSnapshot] = read_engine,
        observer: EngineObserver | None = None,
    ) -> None:
        self.engine = engine
        self.labels = [model_name, ENGINE_INDEX]
        self.read = read
        self.observer = observer
        self.prefix_caching = engine.config.scheduler.enable_prefix_caching
        self.spec_decode = engine.config.speculative is not None
        self.kv_connector = engine.config.kv_transfer is not None

    def describe(self) -> Iterable[Metric]:
        """The families `collect` yields (their names are fixed by the engine's config)."""
        return self._families(_NO_ENGINE)

    def collect(self) -> Iterable[Metric]:
        """One fresh reading of the engine."""
        return self._families(self.read(self.engine))

    def _rows(self, snap: EngineSnapshot) -> list[tuple[str, str, str, float]]:
        """(kind, name, help, value) of each gauge ("g") and counter ("c", exposed with
        "_total") the engine's state gives."""
        s = snap.stats
        total = s.num_kv_blocks
        used = min(max(total - s.num_free_kv_blocks, 0), total)
        usage = used / total if total else 0.0
        rows: list[tuple[str, str, str, float]] = [
            ("g", VLLM + "num_requests_running", "Sequences in the running set.",
             snap.num_running),
            ("g", VLLM + "num_requests_waiting", "Sequences waiting (new or preempted).",
             snap.num_waiting),
            ("g", LOOM + "num_requests_paused", "Idle paused sessions holding KV.",
             snap.num_paused),
            ("g", LOOM + "num_requests_blocked", "Idle sequences blocked on children or a call.",
             snap.num_blocked),
            ("g", LOOM + "num_queued_prompt_tokens",
             "Prompt, fragment and recompute tokens waiting to be computed.",
             snap.num_queued_prompt_tokens),
            ("g", VLLM + "kv_cache_usage_perc", "Share of KV blocks in use (1 = full).", usage),
            ("g", VLLM + "gpu_cache_usage_perc",
             "vllm:kv_cache_usage_perc under vLLM's earlier name.", usage),
            ("g", LOOM + "num_kv_blocks_used", "KV blocks referenced by requests.", used),
            ("g", LOOM + "num_kv_blocks_total", "KV blocks in the pool.", total),
            ("c", VLLM + "num_preemptions", "Preemptions since start.", s.num_preemptions),
            ("c", LOOM + "num_recomputed_tokens", "Tokens computed a second time.",
             s.num_recomputed_tokens),
            ("c", LOOM + "num_computed_tokens", "Token positions the model computed.",
             s.num_computed_tokens),
            ("c", LOOM + "num_engine_steps", "Engine steps that ran a forward pass.",
             s.num_steps),
        ]  # fmt: skip
        if self.prefix_caching:
            queries, hits = s.prefix_cache_queries, s.prefix_cache_hits
            rows += [
                ("c", VLLM + "prefix_cache_queries", "Tokens looked up in the prefix cache.",
                 queries),
                ("c", VLLM + "prefix_cache_hits", "Tokens found in the prefix cache.", hits),
                ("c", VLLM + "gpu_prefix_cache_queries",
                 "vllm:prefix_cache_queries under vLLM's earlier name.", queries),
                ("c", VLLM + "gpu_prefix_cache_hits",
                 "vllm:prefix_cache_hits under vLLM's earlier name.", hits),
                ("g", VLLM + "gpu_prefix_cache_hit_rate",
                 "Prefix cache hits / queries since start.", s.prefix_cache_hit_rate),
                ("g", LOOM + "num_kv_blocks_cached", "KV blocks carrying a prefix-cache hash.",
                 s.num_cached_kv_blocks),
                ("c", LOOM + "kv_blocks_evicted", "Cached KV blocks evicted for reuse.",
                 s.num_evicted_kv_blocks),
            ]  # fmt: skip
        if self.spec_decode:
            drafted, accepted = s.num_draft_tokens, s.num_accepted_draft_tokens
            rows += [
                ("c", VLLM + "spec_decode_num_draft_tokens", "Draft tokens proposed.", drafted),
                ("c", VLLM + "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 accepted),
                ("g", LOOM + "spec_decode_acceptance_rate",
                 "Accepted / drafted tokens since start.",
                 accepted / drafted if drafted else 0.0),
            ]  # fmt: skip
        if self.kv_connector:
            rows += [
                ("c", LOOM + "kv_connector_loaded_tokens", "Tokens whose K/V was loaded.",
                 s.kv_loaded_tokens),
                ("c", LOOM + "kv_connector_gap_tokens", "Tokens computed in gaps of a match.",
                 s.kv_gap_tokens),
                ("c", LOOM + "kv_connector_load_failed_tokens",
                 "Tokens whose K/V load failed.", s.kv_load_failed_tokens),
                ("c", LOOM + "kv_connector_saved_blocks", "KV blocks saved to the store.",
                 s.kv_saved_blocks),
            ]  # fmt: skip
        return rows

    def _families(self, snap: EngineSnapshot) -> list[Metric]:
        families: list[Metric] = []
        for kind, name, doc, value in self._rows(snap):
            cls = CounterMetricFamily if kind == "c" else GaugeMetricFamily
            family = cls(name, doc, labels=list(LABELS))
            family.add_metric(self.labels, value)
            families.append(family)
        steps = HistogramMetricFamily(
            LOOM + "step_time_seconds",
            "Wall time of the engine steps' forward passes (a running stream's gap between "
            "tokens is about one step).", labels=list(LABELS))
        buckets = [("+Inf" if bound == float("inf") else str(bound / 1000), n)
                   for bound, n in snap.step_time_buckets] or [("+Inf", 0)]
        steps.add_metric(self.labels, buckets, snap.step_time_sum_ms / 1000)
        families.append(steps)
        if self.observer is not None:
            families += self.observer.families(self.labels)
        return families


class RequestTimer:
    """One HTTP request's latencies from its arrival at the server: `first_token()` (time to
    first token, once), then `finish()` (end-to-end latency, once). Its tokens and finish
    reason are counted by the `EngineObserver`, which sees every generation path."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._lock = threading.Lock()
        self.arrival = metrics.clock()
        self.first_token_time: float | None = None
        self.finished = False

    def first_token(self) -> None:
        """Note the first output token now and observe TTFT (only the first call counts)."""
        with self._lock:
            if self.first_token_time is not None or self.finished:
                return
            self.first_token_time = self._metrics.clock()
        self._metrics.ttft.observe(max(self.first_token_time - self.arrival, 0.0))

    def finish(self, prompt_tokens: int = 0, generation_tokens: int | None = None,
               finish_reason: str | None = None) -> None:
        """Observe the end-to-end latency once. (The sizes and the reason a route passes are
        not needed here: the observer counts them where the engine produced them.)"""
        with self._lock:
            if self.finished:
                return
            self.finished = True
        self._metrics.e2e.observe(max(self._metrics.clock() - self.arrival, 0.0))


class ServerMetrics:
    """The server's Prometheus registry: engine state at scrape time, generation counted by
    an `EngineObserver`, and request latencies."""

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        *,
        clock: Callable[[], float] = time.perf_counter,
        read: Callable[[LLMEngine], EngineSnapshot] = read_engine,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.clock = clock
        self.registry = CollectorRegistry()
        self.observer = EngineObserver(engine, clock, token_buckets(engine.config.max_model_len))
        # The observer leaves the engine with this object (an engine outlives its servers).
        self.close = weakref.finalize(self, self.observer.detach)
        self.collector = EngineCollector(engine, model_name, read, self.observer)
        self.registry.register(self.collector)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            family = Histogram(VLLM + name, doc, list(LABELS), buckets=buckets,
                               registry=self.registry)
            return family.labels(model_name=model_name, engine=ENGINE_INDEX)

        self.ttft = histogram("time_to_first_token_seconds",
                              "Time from a request's arrival to its first token.", TTFT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Time from a request's arrival to its end.", E2E_BUCKETS)

    def start_request(self) -> RequestTimer:
        """A timer for a request arriving now."""
        return RequestTimer(self)

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type, for `GET /metrics`."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
