"""Helpers shared by the core tests: a scheduler step with a fake model."""

from __future__ import annotations

from loom.core.scheduler import Scheduler
from loom.core.scheduler_output import SchedulerOutput


def run_step(s: Scheduler, sample_token: int = 7) -> SchedulerOutput:
    """One step with a fake model: every chunk reaching the end samples `sample_token`."""
    out = s.schedule()
    s.update_after_step(out)
    for chunk in out.chunks:
        if chunk.needs_logits:
            s.requests[chunk.request_id].append_tokens([sample_token])
    return out
