"""Prometheus metrics of `loom serve` (`GET /metrics`), under vLLM's names and labels.

A metric vLLM also exports has vLLM's name (`vllm:`), type and labels (`model_name` and
`engine`), so dashboards, llm-d's scorers and the production-stack router read Loom as they
read vLLM; the router's older names (`vllm:gpu_cache_usage_perc`, `vllm:gpu_prefix_cache_*`)
are exported beside the current ones. What only Loom has (paused and blocked sessions,
queued prompt tokens, KV blocks, recomputed tokens, step times, the KV connector's
counters) is under `loom:`. One registry per `ServerMetrics` (never the global one, so
several servers or tests in one process do not collide). Two sources, both read at scrape
time by a custom collector (`EngineCollector`):

- engine state: request counts by place in the scheduler, the KV pool, and the engine's own
  counters. Nothing is cached, so nothing is stale, and no thread updates anything between
  scrapes.
- generation, counted where every request's tokens pass whatever route asked for them
  (completions, chat, Responses, sessions, offline): an `EngineObserver`
  (`loom.server.engine_observer`). Tokens, finished requests by reason, time to first
  token and end-to-end latency (from when the engine accepted a request or began a
  session's segment), inter-token latency, per-request sizes.

Concurrency: the observer runs on the engine's step thread or under the async engine's
lock (one writer at a time) and keeps plain counts a scrape copies. A scrape reads the
engine WITHOUT the async engine's lock, possibly while a step runs in its worker thread:
`read_engine` only takes `len()` of the scheduler's containers, copies the idle dict in one
C-level call (`list(dict.values())`, atomic under the GIL; retried should a free-threaded
build see the dict resized) and reads integer attributes. The numbers of one scrape may
therefore mix before and after a step (a request counted neither running nor waiting for an
instant); every value is clamped to its range, and a scrape never raises on account of a
step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from loom.engine.llm_engine import LLMEngine
from loom.engine.stats import EngineStats
from loom.server.engine_observer import EngineObserver

VLLM, LOOM = "vllm:", "loom:"
# vLLM's labels on every metric: the served model, and the engine's index (one engine here).
LABELS: tuple[str, ...] = ("model_name", "engine")
ENGINE_INDEX = "0"


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


def observer_families(observer: EngineObserver, labels: list[str]) -> list[Metric]:
    """The observer's counters and histograms as of now, under vLLM's names."""
    out: list[Metric] = []
    for name, doc, value in (
            ("prompt_tokens", "Prompt tokens of the segments that produced a token.",
             observer.prompt_tokens),
            ("generation_tokens", "Generated tokens.", observer.generation_tokens)):
        family = CounterMetricFamily(VLLM + name, doc, labels=list(LABELS))
        family.add_metric(labels, value)
        out.append(family)
    success = CounterMetricFamily(VLLM + "request_success", "Finished requests by reason.",
                                  labels=[*LABELS, "finished_reason"])
    for reason, count in list(observer.finished.items()):
        success.add_metric([*labels, reason], count)
    out.append(success)
    for buckets, name, doc in (
            (observer.ttft, "time_to_first_token_seconds",
             "Time from a request's (or a session segment's) start to its first token."),
            (observer.e2e, "e2e_request_latency_seconds",
             "Time from a request's (or a session segment's) start to its end."),
            (observer.itl, "inter_token_latency_seconds", "Time between a request's tokens."),
            (observer.tpot, "request_time_per_output_token_seconds",
             "Per request: (last - first token time) / (generated tokens - 1)."),
            (observer.decode_time, "request_decode_time_seconds",
             "Per request: time from its first token to its last."),
            (observer.request_prompt, "request_prompt_tokens", "Prompt tokens per request."),
            (observer.request_generation, "request_generation_tokens",
             "Generated tokens per request.")):
        out.append(buckets.family(VLLM + name, doc, LABELS, labels))
    return out


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
            ("g", LOOM + "num_requests_paused",
             "Idle paused sessions; each holds its KV, except one preempted while idle or "
             "restored from a store with its logits: none until its next operation.",
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
            families += observer_families(self.observer, self.labels)
        return families


class ServerMetrics:
    """The server's Prometheus registry: engine state at scrape time, and generation counted
    by an `EngineObserver` on the engine's clock."""

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        *,
        read: Callable[[LLMEngine], EngineSnapshot] = read_engine,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.observer = EngineObserver(engine, token_buckets(engine.config.max_model_len))
        # The observer leaves the engine with this object (an engine outlives its servers).
        self.close = weakref.finalize(self, self.observer.detach)
        self.collector = EngineCollector(engine, model_name, read, self.observer)
        self.registry.register(self.collector)

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type, for `GET /metrics`."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
