"""`EngineReplica`: one engine (an `AsyncLLMEngine`) as a Ray Serve deployment replica.

Every call comes through `call` (one engine-client coroutine) or `stream` (`outputs`,
`generate`), with the `route` keyword the router read (`loom.distributed.routing.Route`).
Each answers `Served` values: the replica's id and the result, or the `LoomError` the engine
raised, as a value (so the client re-raises exactly that error, with its `param`). A stream
yields one `Served` per output and, if it fails, a last one with the error.

Invariants:
- A call that names a target replica (`Route.replica`) runs only there; another replica
  answers `ReplicaUnavailableError`.
- A call naming an id pinned to another replica (`Route.holder`, gone) that this engine does
  not hold and cannot restore from the shared store answers `SessionLostError` naming that
  replica and why (no store, or no snapshot in it).
- Draining (`drain`, or Serve stopping the replica: scale-down, deletion, SIGTERM) refuses
  new work, stops every generating session's segment (its reader gets the segment's final
  output, `finish_reason` set; the session parks and, with a store, is saved), aborts plain
  requests (their readers get `ReplicaUnavailableError`), and marks the replica gone in the
  directory. A paused session is already in the store (saved when it parked).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from loom.distributed.routing import Route
from loom.engine.config import EngineArgs
from loom.errors import (
    InvalidSessionStateError,
    LoomError,
    ReplicaUnavailableError,
    SessionClosedError,
    SessionLostError,
    UnknownRequestError,
)

logger = logging.getLogger(__name__)

# The engine-client coroutines a replica answers through `call`, and the streams.
CALLS = frozenset({
    "add_request", "holds", "append", "start_segment", "fork_session", "resample", "rewind",
    "get_session", "stop_generation", "save_session", "restore_session", "close", "abort",
    "embed", "readings",
})
STREAMS = frozenset({"outputs", "generate"})
# How long a drain waits for stopped segments to park (and be saved).
DRAIN_PARK_TIMEOUT_S = 10.0
# How often a replica checks whether Serve has begun stopping it.
DRAIN_POLL_S = 0.2


@dataclass(frozen=True)
class Served:
    """A replica's answer: who served it, the value or the error, and whether the replica
    is draining (a refusal then means: retry on another replica)."""

    replica: str
    value: Any = None
    error: LoomError | None = None
    draining: bool = False


@dataclass(frozen=True)
class ReplicaInfo:
    """What a client fetches once: the replica's id and its engine's resolved config."""

    replica: str
    config: Any  # loom.engine.config.EngineConfig


def _named_id(op: str, args: tuple[Any, ...]) -> str | None:
    """The request or session id a call names (None: a new request without one)."""
    if op in ("embed", "generate", "readings") or not args:
        return None
    if op == "restore_session":
        return args[1] if len(args) > 1 and args[1] else (
            args[0] if isinstance(args[0], str) else None)
    return args[0] if isinstance(args[0], str) else None


def serve_is_stopping() -> bool:
    """Whether Ray Serve has begun stopping the replica in this process. Serve exposes no
    public flag: this reads its replica's `_shutting_down` (False if that ever moves: the
    drain then runs from `__del__`, after Serve's own wait for ongoing calls)."""
    try:
        from ray._private.worker import global_worker

        for actor in list(getattr(global_worker, "actors", {}).values()):
            impl = getattr(actor, "_replica_impl", None)
            if impl is not None and getattr(impl, "_shutting_down", False):
                return True
    except Exception:  # a private detail: never let it break a replica
        return False
    return False


class EngineReplica:
    """The deployment class (`launch.engine_deployment` wraps it in `serve.deployment`)."""

    def __init__(self, engine_args: EngineArgs, app_name: str, threads: int | None = None):
        import torch
        from ray import serve

        from loom.engine.async_engine import AsyncLLMEngine
        from loom.engine.llm_engine import LLMEngine

        if threads is not None:
            torch.set_num_threads(threads)
        self.replica_id: str = serve.get_replica_context().replica_id.unique_id
        self.app_name = app_name
        self.engine = AsyncLLMEngine(LLMEngine.from_engine_args(engine_args),
                                     replica=self.replica_id)
        self._draining: str | None = None  # why, once draining
        self._watcher: asyncio.Task[None] | None = None
        directory = self._directory()
        directory.register.remote(self.replica_id)
        # A session the engine ended by itself (expired) loses its pin: the directory does
        # not grow with sessions nobody closed.
        self.engine.on_ended.append(lambda request_id: directory.unpin.remote(request_id))

    def _directory(self) -> Any:
        import ray

        from loom.distributed.directory import DIRECTORY_NAMESPACE, directory_name

        return ray.get_actor(directory_name(self.app_name), namespace=DIRECTORY_NAMESPACE)

    # ---- Serve's hooks -----------------------------------------------------------------

    def record_routing_stats(self) -> dict[str, int]:
        """Serve's routing-statistics hook: the engine's load, read without its lock."""
        load = self.engine.engine.load
        return {"running": load.num_running, "waiting": load.num_waiting,
                "queued_prompt_tokens": load.num_queued_prompt_tokens,
                "draining": int(self._draining is not None)}

    async def __del__(self) -> None:
        """Serve's shutdown hook: drain (if not done), then release the engine."""
        with contextlib.suppress(Exception):
            await self._drain("the replica is shutting down")
        self.engine.shutdown()

    # ---- the calls -----------------------------------------------------------------------

    async def info(self, *, route: Route | None = None) -> ReplicaInfo:
        """The replica's id and engine config."""
        return ReplicaInfo(self.replica_id, self.engine.config)

    async def call(self, op: str, args: tuple[Any, ...] = (),
                   kwargs: dict[str, Any] | None = None, *,
                   route: Route | None = None) -> Served:
        """One engine-client coroutine (`CALLS`), its result or `LoomError` as `Served`."""
        self._ensure_watcher()
        route = route or Route()
        try:
            self._admit(op, route)
            if op == "drain":
                return Served(self.replica_id, await self._drain("drained on request"))
            value = await getattr(self.engine, op)(*args, **(kwargs or {}))
            return Served(self.replica_id, value)
        except LoomError as error:
            return Served(self.replica_id, error=self._explain(error, op, args, route),
                          draining=self._draining is not None)

    async def stream(self, op: str, args: tuple[Any, ...] = (),
                     kwargs: dict[str, Any] | None = None, *,
                     route: Route | None = None) -> AsyncIterator[Served]:
        """A stream (`STREAMS`): one `Served` per output; an error ends it as a last one."""
        self._ensure_watcher()
        route = route or Route()
        try:
            self._admit(op, route)
            source = getattr(self.engine, op)(*args, **(kwargs or {}))
            yield Served(self.replica_id)  # opened here: the client pins to this replica
            async with contextlib.aclosing(source):
                async for out in source:
                    yield Served(self.replica_id, out)
        except LoomError as error:
            yield Served(self.replica_id, error=self._explain(error, op, args, route),
                         draining=self._draining is not None)

    def _admit(self, op: str, route: Route) -> None:
        if op not in CALLS and op not in STREAMS and op != "drain":
            raise ReplicaUnavailableError(f"replicas answer no call {op!r}")
        if route.replica is not None and route.replica != self.replica_id:
            raise ReplicaUnavailableError(f"replica {route.replica} is not running")
        if self._draining is not None and op not in ("readings", "drain", "close", "abort"):
            raise ReplicaUnavailableError(
                f"replica {self.replica_id} is draining ({self._draining}); retry on another")

    def _explain(self, error: LoomError, op: str, args: tuple[Any, ...],
                 route: Route) -> LoomError:
        """The error a caller gets: an unknown id pinned to a gone replica is lost; a
        request aborted by a drain is the replica's unavailability."""
        named = _named_id(op, args)
        if (isinstance(error, UnknownRequestError) and not isinstance(error, SessionClosedError)
                and route.holder is not None and route.holder != self.replica_id):
            store = self.engine.session_store
            why = ("and no shared store keeps sessions" if store is None
                   else "and the shared store keeps no snapshot of it")
            return SessionLostError(
                f"session {named!r} lived on replica {route.holder}, which is gone, {why}")
        if self._draining is not None and isinstance(error, UnknownRequestError):
            return ReplicaUnavailableError(
                f"request {named!r} was aborted: replica {self.replica_id} was drained "
                f"({self._draining})")
        return error

    # ---- draining ----------------------------------------------------------------------

    def _ensure_watcher(self) -> None:
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch_for_stop())

    async def _watch_for_stop(self) -> None:
        while self._draining is None:
            if serve_is_stopping():
                await self._drain("the replica is shutting down")
                return
            await asyncio.sleep(DRAIN_POLL_S)

    async def _drain(self, why: str) -> list[str]:
        """See the module docstring; returns the ids whose segments were stopped."""
        if self._draining is not None:
            return []
        self._draining = why
        with contextlib.suppress(Exception):
            self._directory().mark_gone.remote(self.replica_id, why)
        engine, stopped = self.engine, []
        for request_id in await engine.live_request_ids():
            try:
                view = await engine.get_session(request_id)
            except (InvalidSessionStateError, UnknownRequestError):
                view = None
            try:
                if view is None:
                    await engine.abort(request_id)
                elif await engine.stop_generation(request_id):
                    stopped.append(request_id)
            except LoomError as error:
                logger.warning("draining %s: %s", request_id, error)
        deadline = time.monotonic() + DRAIN_PARK_TIMEOUT_S
        for request_id in stopped:  # wait until each parks (and, with a store, is saved)
            while time.monotonic() < deadline:
                try:
                    if (await engine.get_session(request_id)).status == "PAUSED":
                        break
                except LoomError:
                    break
                await engine.step()
        if stopped:
            await asyncio.wait_for(engine.step(), DRAIN_PARK_TIMEOUT_S)  # the save's flush
        return stopped
