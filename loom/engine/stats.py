"""`EngineStats`: a snapshot of the engine's counters (what a metrics endpoint exports)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from loom.core.request import RequestStatus


@dataclass(frozen=True)
class EngineStats:
    """Engine-wide counters since start; token counts are tokens, not blocks.

    `prefix_cache_queries` counts prompt, fragment and recompute tokens that could have come
    from the prefix cache (all but each one's last token), `prefix_cache_hits` those that did.
    """

    num_steps: int
    num_preemptions: int
    num_recomputed_tokens: int
    num_computed_tokens: int  # positions the model computed (prompts, fragments, decodes)
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_cached_kv_blocks: int
    num_evicted_kv_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    # KV connector (0 without one): tokens whose K/V was loaded from the store, tokens
    # computed in gaps of a match (blocks the store lacked or failed to load), tokens whose
    # load failed, and blocks saved to the store.
    kv_loaded_tokens: int = 0
    kv_gap_tokens: int = 0
    kv_load_failed_tokens: int = 0
    kv_saved_blocks: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits / queries (0 before any query)."""
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else 0.0

    @property
    def kv_cache_usage(self) -> float:
        """Share of the KV pool referenced by requests (cached free blocks are not in use)."""
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks

    def as_dict(self) -> dict[str, Any]:
        """Every counter and derived rate by name."""
        return {
            **asdict(self),
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "kv_cache_usage": self.kv_cache_usage,
        }


# Upper bounds (ms) of the step-time histogram's buckets; the last is +inf.
STEP_TIME_BUCKETS_MS = (5.0, 10.0, 25.0, 50.0, 100.0, 150.0, 250.0, 500.0, 1000.0, 2500.0,
                        float("inf"))


class StepTimes:
    """A histogram of the steps' forward wall times (what a running stream waits per token
    at most): counts per bucket of STEP_TIME_BUCKETS_MS, their sum and number."""

    def __init__(self) -> None:
        self.counts = [0] * len(STEP_TIME_BUCKETS_MS)
        self.sum_ms = 0.0
        self.count = 0

    def observe(self, ms: float) -> None:
        """Count one step of `ms` milliseconds."""
        index = next(i for i, bound in enumerate(STEP_TIME_BUCKETS_MS) if ms <= bound)
        self.counts[index] += 1
        self.sum_ms += ms
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound ms, steps at most that long) per bucket."""
        total, out = 0, []
        for bound, n in zip(STEP_TIME_BUCKETS_MS, self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds now, in sequences (not caller request ids): running, waiting to
    start or resume, paused sessions, blocked sequences (waiting on children or an event),
    and the prompt, fragment and recompute tokens not computed yet."""

    num_running: int
    num_waiting: int
    num_paused: int
    num_blocked: int
    num_queued_prompt_tokens: int


def read_load(running: list[Any], waiting: Any, idle: dict[str, Any]) -> EngineLoad:
    """The load from the scheduler's queues (lists of `Request`), read without the engine's
    lock: a dict that a concurrent step changes while it is copied is copied again."""
    requests: list[Any] = []
    for _ in range(5):
        try:
            requests = list(idle.values())
            break
        except RuntimeError:  # dict changed size during iteration (free-threaded builds)
            continue
    queued = [*list(waiting), *list(running)]
    return EngineLoad(
        num_running=len(running), num_waiting=len(waiting),
        num_paused=sum(1 for r in requests if r.status == RequestStatus.PAUSED),
        num_blocked=sum(1 for r in requests if r.status == RequestStatus.BLOCKED),
        num_queued_prompt_tokens=sum(r.num_uncomputed_tokens for r in queued
                                     if r.num_uncomputed_tokens > 1),
    )
