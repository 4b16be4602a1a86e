"""Prometheus metrics of `loom serve` (`GET /metrics`), named after vLLM's with prefix `loom:`.

Two sources, one registry per `ServerMetrics` (never the global one, so several servers or
tests in one process do not collide):

- engine state, read at scrape time by a custom collector (`EngineCollector`): request
  counts by place in the scheduler, the KV pool, and the engine's own counters (preemptions,
  prefix cache, speculative decoding, KV connector). Nothing is cached, so nothing is stale,
  and no thread updates anything between scrapes.
- request-level metrics the server records through a `RequestTimer` per request: token
  counters, finished requests by reason, and latency / size histograms.

Concurrency: timers are recorded on the asyncio event loop (prometheus_client's metrics
lock internally, and a timer records at most once). A scrape reads the engine WITHOUT the
async engine's lock, possibly while a step runs in its worker thread: `read_engine` only
takes `len()` of the scheduler's containers, copies the idle dict in one C-level call
(`list(dict.values())`, atomic under the GIL; retried should a free-threaded build see the
dict resized) and reads integer attributes. The numbers of one scrape may therefore mix
before and after a step (a request counted neither running nor waiting for an instant);
every value is clamped to its range, and a scrape never raises on account of a step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
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

from loom.engine.llm_engine import LLMEngine
from loom.engine.stats import EngineStats

PREFIX = "loom:"
# finished_reason values of `loom:request_success_total` exported from the start (others,
# such as "unknown" for a request finished without a reason, appear when first recorded).
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")

# vLLM's bucket lists (seconds), with two finer TPOT buckets for fast small models.
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


class EngineCollector(Collector):
    """Exports the engine's state at scrape time; optional groups follow the engine's config."""

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        read: Callable[[LLMEngine], EngineSnapshot] = read_engine,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.read = read
        self.prefix_caching = engine.config.scheduler.enable_prefix_caching
        self.spec_decode = engine.config.speculative is not None
        self.kv_connector = engine.config.kv_transfer is not None

    def describe(self) -> Iterable[Metric]:
        """The families `collect` yields (their names are fixed by the engine's config)."""
        return self._families(_NO_ENGINE)

    def collect(self) -> Iterable[Metric]:
        """One fresh reading of the engine."""
        return self._families(self.read(self.engine))

    def _families(self, snap: EngineSnapshot) -> list[Metric]:
        s = snap.stats
        total = s.num_kv_blocks
        used = min(max(total - s.num_free_kv_blocks, 0), total)
        # (kind, name, help, value): "g" gauge, "c" counter (exposed with "_total").
        rows: list[tuple[str, str, str, float]] = [
            ("g", "num_requests_running", "Sequences in the running set.", snap.num_running),
            ("g", "num_requests_waiting", "Sequences waiting (new or preempted).",
             snap.num_waiting),
            ("g", "num_requests_paused", "Idle paused sessions holding KV.", snap.num_paused),
            ("g", "num_requests_blocked", "Idle sequences blocked on children or a call.",
             snap.num_blocked),
            ("g", "num_queued_prompt_tokens",
             "Prompt, fragment and recompute tokens waiting to be computed.",
             snap.num_queued_prompt_tokens),
            ("g", "kv_cache_usage_perc", "Share of KV blocks in use (1 = full).",
             used / total if total else 0.0),
            ("g", "num_kv_blocks_used", "KV blocks referenced by requests.", used),
            ("g", "num_kv_blocks_total", "KV blocks in the pool.", total),
            ("c", "num_preemptions", "Preemptions since start.", s.num_preemptions),
            ("c", "num_recomputed_tokens", "Tokens computed a second time.",
             s.num_recomputed_tokens),
            ("c", "num_computed_tokens", "Token positions the model computed.",
             s.num_computed_tokens),
            ("c", "num_engine_steps", "Engine steps that ran a forward pass.", s.num_steps),
        ]  # fmt: skip
        if self.prefix_caching:
            rows += [
                ("c", "prefix_cache_queries", "Tokens looked up in the prefix cache.",
                 s.prefix_cache_queries),
                ("c", "prefix_cache_hits", "Tokens found in the prefix cache.",
                 s.prefix_cache_hits),
                ("g", "prefix_cache_hit_rate", "Prefix cache hits / queries since start.",
                 s.prefix_cache_hit_rate),
                ("g", "num_kv_blocks_cached", "KV blocks carrying a prefix-cache hash.",
                 s.num_cached_kv_blocks),
                ("c", "kv_blocks_evicted", "Cached KV blocks evicted for reuse.",
                 s.num_evicted_kv_blocks),
            ]  # fmt: skip
        if self.spec_decode:
            drafted, accepted = s.num_draft_tokens, s.num_accepted_draft_tokens
            rows += [
                ("c", "spec_decode_num_draft_tokens", "Draft tokens proposed.", drafted),
                ("c", "spec_decode_num_accepted_tokens", "Draft tokens accepted.", accepted),
                ("g", "spec_decode_acceptance_rate", "Accepted / drafted tokens since start.",
                 accepted / drafted if drafted else 0.0),
            ]  # fmt: skip
        if self.kv_connector:
            rows += [
                ("c", "kv_connector_loaded_tokens", "Tokens whose K/V was loaded.",
                 s.kv_loaded_tokens),
                ("c", "kv_connector_gap_tokens", "Tokens computed in gaps of a match.",
                 s.kv_gap_tokens),
                ("c", "kv_connector_load_failed_tokens", "Tokens whose K/V load failed.",
                 s.kv_load_failed_tokens),
                ("c", "kv_connector_saved_blocks", "KV blocks saved to the store.",
                 s.kv_saved_blocks),
            ]  # fmt: skip
        families: list[Metric] = []
        for kind, name, doc, value in rows:
            cls = CounterMetricFamily if kind == "c" else GaugeMetricFamily
            family = cls(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            families.append(family)
        steps = HistogramMetricFamily(
            PREFIX + "step_time_seconds",
            "Wall time of the engine steps' forward passes (a running stream's gap between "
            "tokens is about one step).", labels=["model_name"])
        buckets = [("+Inf" if bound == float("inf") else str(bound / 1000), n)
                   for bound, n in snap.step_time_buckets] or [("+Inf", 0)]
        steps.add_metric([self.model_name], buckets, snap.step_time_sum_ms / 1000)
        families.append(steps)
        return families


class RequestTimer:
    """One request's timings: `first_token()`, `tokens(n)`, then `finish(...)` records once."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._lock = threading.Lock()
        self.arrival = metrics.clock()
        self.first_token_time: float | None = None
        self.num_generation_tokens = 0
        self.finished = False

    def first_token(self) -> None:
        """Note the first output token now and observe TTFT (only the first call counts)."""
        with self._lock:
            if self.first_token_time is not None or self.finished:
                return
            self.first_token_time = self._metrics.clock()
        self._metrics.ttft.observe(max(self.first_token_time - self.arrival, 0.0))

    def tokens(self, n: int) -> None:
        """Note that n output tokens exist so far (the first time n > 0 is the first token)."""
        if n > 0:
            self.first_token()
        with self._lock:
            self.num_generation_tokens = max(self.num_generation_tokens, n)

    def finish(
        self,
        prompt_tokens: int,
        generation_tokens: int | None = None,
        finish_reason: str | None = None,
    ) -> None:
        """Record the request once (generation_tokens defaults to what `tokens` noted)."""
        with self._lock:
            if self.finished:
                return
            self.finished = True
            now = self._metrics.clock()
        gen = self.num_generation_tokens if generation_tokens is None else generation_tokens
        self._metrics.record_finished(
            prompt_tokens=max(prompt_tokens, 0),
            generation_tokens=max(gen, 0),
            finish_reason=finish_reason or "unknown",
            e2e=max(now - self.arrival, 0.0),
            decode_time=None if self.first_token_time is None else now - self.first_token_time,
        )


class ServerMetrics:
    """The server's Prometheus registry: engine state at scrape time plus request metrics."""

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
        self.collector = EngineCollector(engine, model_name, read)
        self.registry.register(self.collector)
        token_bins = token_buckets(engine.config.max_model_len)

        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name", *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            family = Histogram(
                PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry
            )
            return family.labels(model_name=model_name)

        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of finished requests."
        ).labels(model_name=model_name)
        self.generation_tokens = counter(
            "generation_tokens", "Generated tokens of finished requests."
        ).labels(model_name=model_name)
        self.request_success = counter(
            "request_success", "Finished requests by finish reason.", ["finished_reason"]
        )
        for reason in FINISH_REASONS:  # exported at 0 from the start, as vLLM does
            self.request_success.labels(model_name=model_name, finished_reason=reason)
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time from arrival to first token.", TTFT_BUCKETS
        )
        self.tpot = histogram(
            "time_per_output_token_seconds",
            "Per request: (finish - first token) / (generation tokens - 1).",
            TPOT_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Time from arrival to finish.", E2E_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", token_bins
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", token_bins
        )

    def start_request(self) -> RequestTimer:
        """A timer for a request arriving now."""
        return RequestTimer(self)

    def record_finished(
        self,
        *,
        prompt_tokens: int,
        generation_tokens: int,
        finish_reason: str,
        e2e: float,
        decode_time: float | None,
    ) -> None:
        """Record one finished request (what `RequestTimer.finish` calls)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.request_success.labels(
            model_name=self.model_name, finished_reason=finish_reason
        ).inc()
        self.e2e.observe(e2e)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        if decode_time is not None and generation_tokens > 1:
            self.tpot.observe(max(decode_time, 0.0) / (generation_tokens - 1))

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type, for `GET /metrics`."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
