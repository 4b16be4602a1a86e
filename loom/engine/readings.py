"""`EngineReading`: what one engine is and has done, read at one moment, for `/metrics`.

An engine's state (request counts by place in the scheduler, the KV pool, its counters, its
step times) is read through its API without the async engine's lock, possibly while a step
runs on its worker thread: `LLMEngine.load` takes only `len()` of the scheduler's containers
and copies the idle dict in one C-level call, the rest are integer attributes. The numbers
of one reading may therefore mix before and after a step (a request counted neither running
nor waiting for an instant); the exporter clamps every value to its range, and a reading
never raises on account of a step. A reading is plain data: a replica's crosses processes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from loom.engine.engine_observer import ObservedGeneration
from loom.engine.stats import EngineStats

if TYPE_CHECKING:
    from loom.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class EngineSnapshot:
    """An engine's state and counters (sequence counts, not caller request ids)."""

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


NO_ENGINE = EngineSnapshot(0, 0, 0, 0, EngineStats(**{f.name: 0 for f in fields(EngineStats)}))


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


@dataclass(frozen=True)
class EngineReading:
    """One engine's snapshot and observed generation (None where nothing observes it),
    named by its replica ("" for the one engine of an in-process server)."""

    replica: str
    snapshot: EngineSnapshot
    observed: ObservedGeneration | None = None
