"""A tensor-parallel worker: ranks 1..N-1, each running its shard of every step.

    python -m loom.parallel.worker RANK WORLD_SIZE HOST PORT LOCAL_RANK

is what the driver starts (`loom.parallel.executor`); under torchrun the ranks above 0 reach
`serve` from the engine's constructor instead. The loop:

    build this rank's runner; report (None or the error) to rank 0   (gather, control group)
    repeat:  receive the step's SchedulerOutput from rank 0           (broadcast)
             None: stop
             execute_model: the same forward as every rank, the model's collectives inside
             with a KV connector: send this rank's load errors and failure to rank 0

A worker that fails leaves the reason in the store (`report_error`) and exits; its closed
sockets fail the other ranks' next collective, and the driver reads the reason.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback

import torch.distributed as dist

from loom.parallel.group import TensorParallelGroup, step_timeout
from loom.parallel.threads import ComputeThreads, cores_per_rank
from loom.runner.rank_runner import RunnerSpec, build_runner, rank_device

logger = logging.getLogger("loom")

SPEC_KEY = "loom/spec"


def serve(group: TensorParallelGroup, spec: RunnerSpec, local_rank: int) -> int:
    """Build this rank's runner, then run the driver's steps until it says stop; returns the
    process's exit status."""
    runner, error = None, None
    try:
        runner = build_runner(spec, group.rank, local_rank, group)
    except Exception as exc:
        error = f"rank {group.rank} could not load the model: {type(exc).__name__}: {exc}"
    group.gather_objects(error)
    if runner is None:
        return 1
    while True:
        step = group.broadcast_object()
        if step is None:
            return 0
        try:
            result = runner.execute_model(step)  # type: ignore[arg-type]
        except Exception as exc:
            group.report_error(f"rank {group.rank} failed in a step: {type(exc).__name__}: "
                               f"{exc}\n{traceback.format_exc()}")
            raise
        if runner.kv_connector is not None:
            group.gather_objects((result.load_errors, result.load_failure))


def _exit_with_parent(poll_s: float = 0.5) -> None:
    """Exit when the driver process is gone (its sockets also fail this rank's next
    collective; this covers a worker idle between steps). Polled on a daemon thread: Linux's
    PR_SET_PDEATHSIG would fire when the driver *thread* that started us ends, which may be
    any thread of a live driver."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(3)

    threading.Thread(target=watch, name="loom-parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    """Entry point of a spawned worker (see the module docstring)."""
    rank, world, host, port, local_rank = argv[0], argv[1], argv[2], argv[3], argv[4]
    _exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    logging.basicConfig(level=os.environ.get("LOOM_LOG_LEVEL", "WARNING"))
    store = dist.TCPStore(host, int(port), int(world), is_master=False,
                          timeout=step_timeout())
    store.set(f"loom/joined/{rank}", "1")
    spec: RunnerSpec = pickle.loads(store.get(SPEC_KEY))
    threads = ComputeThreads(cores_per_rank(int(world)))
    threads.apply()
    group = TensorParallelGroup.create(int(rank), int(world), store,
                                       rank_device(spec.device, int(local_rank)))
    try:
        return serve(group, spec, int(local_rank))
    finally:
        group.destroy()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
