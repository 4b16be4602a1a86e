"""Prometheus metrics of `loom serve` (`GET /metrics`), under vLLM's names and labels.

A metric vLLM also exports has vLLM's name (`vllm:`), type and labels (`model_name` and
`engine`), so dashboards, llm-d's scorers and the production-stack router read Loom as they
read vLLM; the router's older names (`vllm:gpu_cache_usage_perc`, `vllm:gpu_prefix_cache_*`)
are exported beside the current ones. What only Loom has (paused and blocked sessions,
queued prompt tokens, KV blocks, recomputed tokens, step times, the KV connector's
counters) is under `loom:`. One registry per exporter (never the global one, so several
servers or tests in one process do not collide).

A scrape exports the `EngineReading`s the engine client gives (`loom/engine/readings.py`):
one for an in-process engine, one per replica behind Ray Serve. Each reading is an engine's
state at scrape time (nothing is cached, so nothing is stale, and no thread updates
anything between scrapes) and the generation its `EngineObserver` counted where every
request's tokens pass (`loom/engine/engine_observer.py`: tokens, finished requests by
reason, time to first token, end-to-end and inter-token latency, per-request sizes). With
replicas, each series carries the replica's index as vLLM's `engine` label (as vLLM labels
its data-parallel engines) and its Ray replica id as `replica`.

Every value is clamped to its range: a reading taken while a step runs may mix before and
after it, and a scrape never raises on account of a step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from loom.engine.config import EngineConfig
from loom.engine.engine_observer import EngineObserver, Histogram, ObservedGeneration
from loom.engine.engine_observer import token_buckets as token_buckets
from loom.engine.llm_engine import LLMEngine
from loom.engine.readings import NO_ENGINE, EngineReading, EngineSnapshot, read_engine

VLLM, LOOM = "vllm:", "loom:"
# vLLM's labels on every metric: the served model, and the engine's index.
LABELS: tuple[str, ...] = ("model_name", "engine")
# With replicas, each series also names its replica.
REPLICA_LABELS: tuple[str, ...] = (*LABELS, "replica")


def _histogram(family: HistogramMetricFamily, labels: list[str], histogram: Histogram) -> None:
    """Add one labelled histogram to `family`."""
    buckets = [("+Inf" if bound == float("inf") else floatToGoString(bound), count)
               for bound, count in histogram.cumulative()]
    family.add_metric(labels, buckets, histogram.sum)


# The observer's histograms: (attribute, vLLM's name, help).
_OBSERVED_HISTOGRAMS: tuple[tuple[str, str, str], ...] = (
    ("ttft", "time_to_first_token_seconds",
     "Time from a request's (or a session segment's) start to its first token."),
    ("e2e", "e2e_request_latency_seconds",
     "Time from a request's (or a session segment's) start to its end."),
    ("itl", "inter_token_latency_seconds", "Time between a request's tokens."),
    ("tpot", "request_time_per_output_token_seconds",
     "Per request: (last - first token time) / (generated tokens - 1)."),
    ("decode_time", "request_decode_time_seconds",
     "Per request: time from its first token to its last."),
    ("request_prompt", "request_prompt_tokens", "Prompt tokens per request."),
    ("request_generation", "request_generation_tokens", "Generated tokens per request."),
)


class EngineCollector(Collector):
    """Exports the readings `read` gives at scrape time (one per engine); optional groups
    follow the engines' config."""

    def __init__(self, config: EngineConfig, model_name: str,
                 read: Callable[[], Sequence[EngineReading]]) -> None:
        self.model_name = model_name
        self.read = read
        self.prefix_caching = config.scheduler.enable_prefix_caching
        self.spec_decode = config.speculative is not None
        self.kv_connector = config.kv_transfer is not None

    def describe(self) -> Iterable[Metric]:
        """The families `collect` yields (their names are fixed by the engines' config)."""
        return self._families([EngineReading("", NO_ENGINE)])

    def collect(self) -> Iterable[Metric]:
        """The readings of now."""
        return self._families(list(self.read()))

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

    def _families(self, readings: list[EngineReading]) -> list[Metric]:
        """One family per metric, one sample per engine (labelled by its index, and by its
        replica where it has one)."""
        replicas = any(r.replica for r in readings)
        names = list(REPLICA_LABELS if replicas else LABELS)
        labelled = [([self.model_name, str(index), *([r.replica] if replicas else [])], r)
                    for index, r in enumerate(readings)]
        families: dict[str, Metric] = {}
        for labels, reading in labelled:
            for kind, name, doc, value in self._rows(reading.snapshot):
                if name not in families:
                    cls = CounterMetricFamily if kind == "c" else GaugeMetricFamily
                    families[name] = cls(name, doc, labels=names)
                families[name].add_metric(labels, value)
        out = list(families.values())
        steps = HistogramMetricFamily(
            LOOM + "step_time_seconds",
            "Wall time of the engine steps' forward passes (a running stream's gap between "
            "tokens is about one step).", labels=names)
        for labels, reading in labelled:
            snap = reading.snapshot
            buckets = [("+Inf" if bound == float("inf") else str(bound / 1000), n)
                       for bound, n in snap.step_time_buckets] or [("+Inf", 0)]
            steps.add_metric(labels, buckets, snap.step_time_sum_ms / 1000)
        out.append(steps)
        observed = [(labels, r.observed) for labels, r in labelled if r.observed is not None]
        if observed:
            out += observed_families(observed, names)
        return out


def observed_families(observed: list[tuple[list[str], ObservedGeneration]],
                      names: list[str]) -> list[Metric]:
    """The observers' counters and histograms, under vLLM's names."""
    out: list[Metric] = []
    for attr, doc in (("prompt_tokens", "Prompt tokens of the segments that produced a token."),
                      ("generation_tokens", "Generated tokens.")):
        family = CounterMetricFamily(VLLM + attr, doc, labels=names)
        for labels, counts in observed:
            family.add_metric(labels, getattr(counts, attr))
        out.append(family)
    success = CounterMetricFamily(VLLM + "request_success", "Finished requests by reason.",
                                  labels=[*names, "finished_reason"])
    for labels, counts in observed:
        for reason, count in counts.finished.items():
            success.add_metric([*labels, reason], count)
    out.append(success)
    for attr, name, doc in _OBSERVED_HISTOGRAMS:
        family = HistogramMetricFamily(VLLM + name, doc, labels=names)
        for labels, counts in observed:
            _histogram(family, labels, getattr(counts, attr))
        out.append(family)
    return out


class MetricsExporter:
    """A registry exporting the readings each scrape is given: `render(readings)`."""

    def __init__(self, config: EngineConfig, model_name: str) -> None:
        self._readings: list[EngineReading] = []
        self.registry = CollectorRegistry()
        self.collector = EngineCollector(config, model_name, lambda: self._readings)
        self.registry.register(self.collector)

    def render(self, readings: Sequence[EngineReading]) -> tuple[bytes, str]:
        """The exposition body of these readings and its content type."""
        self._readings = list(readings)
        try:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        finally:
            self._readings = []


class ServerMetrics:
    """Metrics of one `LLMEngine` in this process: its state read at scrape time, and
    generation counted by an `EngineObserver` of its own from now on."""

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        *,
        read: Callable[[LLMEngine], EngineSnapshot] = read_engine,
    ) -> None:
        self.engine = engine
        self.observer = EngineObserver(engine)
        # The observer leaves the engine with this object (an engine outlives its servers).
        self.close = weakref.finalize(self, self.observer.detach)
        self.exporter = MetricsExporter(engine.config, model_name)
        self.registry = self.exporter.registry
        self._read = read

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type, for `GET /metrics`."""
        reading = EngineReading("", self._read(self.engine), self.observer.counts())
        return self.exporter.render([reading])
