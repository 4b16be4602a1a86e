"""`Executor`: what the engine core calls once per step, on one device or on many."""

from __future__ import annotations

from typing import Any, Protocol

from loom.core.scheduler_output import SchedulerOutput
from loom.runner.model_runner import ModelOutput


class Executor(Protocol):
    """Runs a scheduled step and owns the KV pools it writes.

    `ModelRunner` is the one-device executor; `loom.parallel.TensorParallelExecutor` runs the
    same step on every rank of a tensor-parallel group. `kv_connector` is the (rank 0) worker
    half of a KV connector, or None; `shutdown` releases devices and processes (idempotent).
    """

    kv_connector: Any

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        """One step: block copies, connector loads, the forward, connector saves."""
        ...

    def shutdown(self) -> None:
        """Release what the executor holds; later steps fail."""
        ...
