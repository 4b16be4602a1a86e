"""`TensorParallelExecutor`: the engine's executor over N ranks, driven from rank 0.

    driver process (rank 0)                          worker processes (ranks 1..N-1)
    EngineCore: scheduler, sessions, hooks,
    sampling, outputs
       |  execute_model(SchedulerOutput)
       v
    TensorParallelExecutor ---- SchedulerOutput ---> worker loop (loom.parallel.worker)
       |  (broadcast, control group, once a step)        |
    ModelRunner, shard 0  <==== all-reduce per layer ==> ModelRunner, shard r
                          <==== all-gather of logits ==>
       |  <--- KV load errors, failures (gather; with a connector)
    ModelOutput (logits of the whole vocabulary)

The engine core sees one executor with the same `execute_model` as a `ModelRunner`; the
scheduler's block tables, the prefix cache and every session stay in the driver.

Start-up: the driver serves a TCP store on a free loopback port, starts the workers
(`python -m loom.parallel.worker`: a fresh interpreter, so no caller's script runs again),
hands them the `RunnerSpec` through the store, and every rank loads its shard of the model in
parallel. Under torchrun (`WORLD_SIZE` set in the environment) nothing is started: the
processes torchrun launched meet through `MASTER_ADDR:MASTER_PORT`, rank 0 drives, and the
others serve steps from inside the engine's constructor until the driver stops, then exit.

Faults: a rank that dies, raises or stops answering fails the step (its requests fail with a
`TensorParallelError` naming the rank and why); the executor then stops every worker and fails
each later step at once. Workers exit when the driver process is gone, ignore Ctrl-C (the
driver shuts them down), and `shutdown()` (also run at interpreter exit) ends them all.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from loom.core.scheduler_output import SchedulerOutput
from loom.errors import TensorParallelError
from loom.parallel.group import TensorParallelGroup, step_timeout
from loom.parallel.threads import ComputeThreads, cores_per_rank
from loom.parallel.worker import SPEC_KEY, serve
from loom.runner.model_runner import ModelOutput, ModelRunner
from loom.runner.rank_runner import RunnerSpec, build_runner, rank_device

logger = logging.getLogger("loom")

# How long a stopping worker gets to exit before it is killed.
_EXIT_GRACE_S = 10.0


class TensorParallelExecutor:
    """Runs each step on every rank of a tensor-parallel group (see the module docstring)."""

    def __init__(self, runner: ModelRunner, group: TensorParallelGroup,
                 workers: list[subprocess.Popen[bytes]], threads: ComputeThreads) -> None:
        self.runner = runner  # rank 0's shard
        self.group = group
        self.workers = workers  # empty under torchrun (the ranks are not our children)
        self.threads = threads
        self._failure: TensorParallelError | None = None
        self._closed = False
        self._stepping = threading.Lock()
        atexit.register(self.shutdown)

    @property
    def kv_connector(self) -> object:
        """Rank 0's worker half of the KV connector (its counters), or None."""
        return self.runner.kv_connector

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        """Run the step on every rank; rank 0's output, with every rank's load errors."""
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise TensorParallelError("the tensor-parallel executor was shut down")
        with self._stepping:
            self.threads.apply()
            try:
                self.group.broadcast_object(scheduler_output)
                result = self.runner.execute_model(scheduler_output)
                if self.runner.kv_connector is not None:
                    result = self._merge_load_reports(result)
                return result
            except Exception as error:
                # The ranks no longer agree where they are in the step: the group is over.
                raise self._fail(error) from error

    def _merge_load_reports(self, result: ModelOutput) -> ModelOutput:
        """Every rank's KV load errors and failures on rank 0's output: a block one rank
        could not load is not loaded (its tokens are recomputed or fail by the policy)."""
        errors: dict[int, str] = {}
        failures = []
        reports = self.group.gather_objects((result.load_errors, result.load_failure)) or []
        for rank, (rank_errors, failure) in enumerate(reports):  # type: ignore[misc]
            errors.update(rank_errors)
            if failure is not None:
                failures.append(f"rank {rank}: {failure}")
        return dataclasses.replace(result, load_errors=errors,
                                   load_failure="; ".join(failures) or None)

    def _fail(self, error: Exception) -> TensorParallelError:
        deadline = time.monotonic() + 2.0  # let a dying worker finish dying
        while self.workers and time.monotonic() < deadline and all(
                w.poll() is None for w in self.workers):
            time.sleep(0.05)
        reasons = self.group.reported_errors()
        parts = []
        for rank, worker in enumerate(self.workers, start=1):
            code = worker.poll()
            if rank in reasons:
                parts.append(reasons[rank].splitlines()[0])
            elif code is not None:
                parts.append(f"rank {rank} died (exit code {code})")
        cause = "; ".join(parts) or f"rank 0: {type(error).__name__}: {error}"
        self._failure = TensorParallelError(
            f"tensor-parallel step failed ({cause}); the group is stopped and this engine "
            "cannot run more steps")
        logger.error("%s", self._failure)
        self._stop(polite=False)
        return self._failure

    def shutdown(self) -> None:
        """Stop every worker and leave the process group (idempotent)."""
        if self._closed:
            return
        idle = self._stepping.acquire(timeout=1.0)
        try:
            if not idle:
                # A step is in flight on another thread: stopping the workers fails its
                # collectives at once; the group is torn down only after it has let go.
                stop_workers(self.workers, grace_s=0.0)
                idle = self._stepping.acquire(timeout=60.0)
            self._stop(polite=idle and self._failure is None)
        finally:
            if idle:
                self._stepping.release()

    def _stop(self, polite: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if polite:
            try:
                self.group.broadcast_object(None)
            except Exception as error:
                logger.warning("could not tell the workers to stop: %s", error)
        stop_workers(self.workers, grace_s=_EXIT_GRACE_S if polite else 0.0)
        self.group.destroy()
        self.threads.restore()
        atexit.unregister(self.shutdown)


def stop_workers(workers: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """Wait up to `grace_s` for the workers to exit, then terminate and kill the rest."""
    deadline = time.monotonic() + grace_s
    for worker in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.wait(timeout=max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if worker.poll() is None:
            worker.terminate()
    for worker in workers:
        try:
            worker.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def launched_by_torchrun() -> bool:
    """Whether torch.distributed's environment names this process's rank (torchrun)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def launch(spec: RunnerSpec) -> TensorParallelExecutor:
    """Start (or, under torchrun, join) the group of `spec.tensor_parallel_size` ranks and
    build rank 0's runner. Under torchrun a rank above 0 serves steps here until the driver
    stops, then exits the process."""
    world = spec.tensor_parallel_size
    if launched_by_torchrun():
        return _join_torchrun(spec, world)
    threads = ComputeThreads(cores_per_rank(world))
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=step_timeout(),
                          wait_for_workers=False)
    store.set(SPEC_KEY, pickle.dumps(spec))
    workers = [_spawn_worker(rank, world, store.port) for rank in range(1, world)]
    try:
        _wait_for_workers(store, workers)
        group = TensorParallelGroup.create(0, world, store, rank_device(spec.device, 0))
    except BaseException:
        stop_workers(workers, grace_s=0.0)
        threads.restore()
        raise
    return _start_driver(spec, group, workers, threads)


def _join_torchrun(spec: RunnerSpec, world: int) -> TensorParallelExecutor:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if size != world:
        raise TensorParallelError(
            f"torchrun started {size} processes (WORLD_SIZE) but tensor_parallel_size is "
            f"{world}: start one process per rank")
    # torchrun sets OMP_NUM_THREADS=1 for several ranks per machine: split the cores instead.
    threads = ComputeThreads(cores_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    threads.apply()
    group = TensorParallelGroup.create(rank, world, None, rank_device(spec.device, local_rank))
    if rank != 0:
        try:
            status = serve(group, spec, local_rank)
        finally:
            group.destroy()
        raise SystemExit(status)
    return _start_driver(spec, group, [], threads)


def _start_driver(spec: RunnerSpec, group: TensorParallelGroup,
                  workers: list[subprocess.Popen[bytes]],
                  threads: ComputeThreads) -> TensorParallelExecutor:
    """Build rank 0's runner, collect every rank's start-up result, fail cleanly if any
    rank could not start."""
    threads.apply()
    runner, error = None, None
    try:
        runner = build_runner(spec, 0, 0, group)
    except Exception as exc:
        error = exc
    try:
        reports = group.gather_objects(None if error is None else str(error)) or []
    except Exception as exc:  # a worker died while loading
        reports = [f"a worker died while loading the model: {exc}"]
    problems = [r for r in reports[1:] if r is not None]
    if error is not None or problems or runner is None:
        with contextlib.suppress(Exception):
            group.broadcast_object(None)  # the workers that did start stop now
        stop_workers(workers, grace_s=_EXIT_GRACE_S)
        group.destroy()
        threads.restore()
        if error is not None:
            raise error
        raise TensorParallelError("tensor-parallel start-up failed: " + "; ".join(
            str(p) for p in problems))
    logger.info("tensor parallel: %d ranks, %d threads each", group.world_size, threads.count)
    return TensorParallelExecutor(runner, group, workers, threads)


def _spawn_worker(rank: int, world: int, port: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(cores_per_rank(world))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # ours, not a torchrun's
        env.pop(name, None)
    return subprocess.Popen(
        [sys.executable, "-m", "loom.parallel.worker", str(rank), str(world), "127.0.0.1",
         str(port), str(rank)],
        env=env, stdin=subprocess.DEVNULL,
    )


def _wait_for_workers(store: dist.TCPStore, workers: list[subprocess.Popen[bytes]]) -> None:
    """Until every worker has reached the store; a worker that exits first fails start-up
    with its exit code instead of a timeout."""
    keys = [f"loom/joined/{rank}" for rank in range(1, len(workers) + 1)]
    deadline = time.monotonic() + step_timeout().total_seconds()
    while not store.check(keys):
        for rank, worker in enumerate(workers, start=1):
            if worker.poll() is not None:
                raise TensorParallelError(
                    f"tensor-parallel worker rank {rank} exited during start-up (exit code "
                    f"{worker.returncode}); its output above says why")
        if time.monotonic() > deadline:
            raise TensorParallelError("tensor-parallel workers did not start in time")
        time.sleep(0.02)
