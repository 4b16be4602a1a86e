"""`RayEngineClient`: the engine-client protocol (`loom/engine/client.py`) over N engine
replicas behind a Ray Serve deployment handle.

Each protocol call becomes one replica call (`EngineReplica.call` / `.stream`) with a
`Route`: the id it names and the replica the directory pins that id to (`Pins`), or, for a
new request, the hashes of its prompt's full blocks (the router's prefix match). The
replica answers `Served` (its id and the value, or the `LoomError`, re-raised here as is).

Pins follow the answers: a call that creates an id (open, fork, restore, generate) pins it
to the replica that answered, before returning; a call served by another replica than the
pinned one (the holder was gone and the session continued from the shared store there)
moves the pin; close and abort remove it. A call that finds its replica dead (Ray's actor
errors) marks the replica gone and is retried once elsewhere (the router never picks a
replica the route avoids while another runs); a stream cut by a dead replica ends with
`ReplicaUnavailableError`, never a hang. `replica_of(id)` names the replica that last
served an id (the server's `x-loom-replica` header).

The model's facts are local: the config is fetched from a replica once, the tokenizer and
input processor are built here from it, and the session store is opened here from the
config's KV transfer settings (the same store the replicas share, or None).

The affinity key of the calls' `CallScope` (`loom.engine.client.call_scope`: an
`x-session-id` header, say) pins the new requests made under it to one replica, as a
session id would.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

from loom.distributed.directory import Pins
from loom.distributed.live import running_replicas
from loom.distributed.replica import ReplicaInfo, Served
from loom.distributed.routing import Route, prefix_hashes
from loom.engine.client import current_scope
from loom.engine.config import EngineConfig
from loom.engine.input_processor import InputProcessor
from loom.engine.outputs import RequestOutput
from loom.engine.pooling import EmbeddingRequestOutput, check_dimensions
from loom.engine.session_snapshot import SessionSnapshot
from loom.engine.session_store import SessionStore
from loom.engine.sessions import Sample, SessionView
from loom.engine.token_budget import TokenBudget
from loom.errors import (
    EngineShutDownError,
    LoomError,
    ReplicaUnavailableError,
    SessionLostError,
)
from loom.pooling_params import PoolingParams
from loom.sampling_params import SamplingParams
from loom.tokenizer import Tokenizer

_ids = itertools.count()


def _affinity() -> str | None:
    """The affinity key of the new requests made in this context (`call_scope`)."""
    scope = current_scope()
    return scope.affinity if scope is not None else None

# How many ids `replica_of` remembers after their pins are gone.
_SERVED_MEMORY = 10_000


def _dead_replica_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorUnavailableError, RayActorError

    return (RayActorError, ActorUnavailableError)


def local_session_store(config: EngineConfig) -> SessionStore | None:
    """The session store the replicas share, opened in this process (None without one)."""
    if config.kv_transfer is None or config.kv_cache_spec is None:
        return None
    from loom.kv_connector.config import KVConnectorRole
    from loom.kv_connector.factory import create_connector

    connector = create_connector(config.kv_transfer, config.kv_cache_spec,
                                 KVConnectorRole.SCHEDULER)
    store = getattr(connector, "store", None)
    if store is None:
        return None
    return SessionStore(store, config.kv_cache_spec.fingerprint,
                        save=config.kv_transfer.is_producer, load=config.kv_transfer.is_consumer)


class RayEngineClient:
    """The engine-client protocol over a deployment of `EngineReplica`s (see the module
    docstring). Built by `loom.distributed.launch.start_replicas`."""

    def __init__(self, handle: Any, app_name: str, deployment: str, pins: Pins,
                 *, on_shutdown: Callable[[], None] | None = None) -> None:
        from loom.engine.structured_output import StructuredOutputs
        from loom.tokenizer import load_tokenizer

        self._handle = handle
        # One handle per kind of call, made once (Serve gives each its router).
        self._calls = handle.options(method_name="call")
        self._streams = handle.options(method_name="stream", stream=True)
        self.app_name = app_name
        self.deployment = deployment
        self.pins = pins
        self._on_shutdown = on_shutdown
        self._closed: EngineShutDownError | None = None
        self._served: OrderedDict[str, str] = OrderedDict()
        info: ReplicaInfo = handle.options(method_name="info").remote(route=Route()).result()
        self._config: EngineConfig = info.config
        self._tokenizer = load_tokenizer(info.config.tokenizer_path)
        self._inputs = InputProcessor(
            self._tokenizer, info.config.vocab_size, info.config.max_model_len,
            structured=StructuredOutputs(self._tokenizer, info.config.vocab_size))
        self._session_store = local_session_store(info.config)
        # Engines ending requests by themselves (expiry) are not reported across Ray yet.
        self.on_ended: list[Callable[[str], None]] = []

    # ---- the model's facts, read locally -------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def inputs(self) -> InputProcessor:
        return self._inputs

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def max_model_len(self) -> int:
        return self._config.max_model_len

    @property
    def session_store(self) -> SessionStore | None:
        return self._session_store

    def check_pooling_params(self, params: PoolingParams) -> None:
        check_dimensions(params, self._config.embedding_dimensions)

    # ---- routing -------------------------------------------------------------------------

    def replica_of(self, request_id: str) -> str | None:
        """The replica that holds or last served `request_id` (None: unknown here)."""
        return self.pins.cached(request_id) or self._served.get(request_id)

    def running_replicas(self) -> frozenset[str]:
        """The replica ids Serve reports running (as this process's router last saw)."""
        return running_replicas(self.app_name, self.deployment)

    def _remember(self, request_id: str, replica: str) -> None:
        scope = current_scope()
        if scope is not None:
            scope.note_served(replica)
        self._served[request_id] = replica
        self._served.move_to_end(request_id)
        while len(self._served) > _SERVED_MEMORY:
            self._served.popitem(last=False)

    def _prefix(self, prompt: str | Sequence[int] | None) -> tuple[bytes, ...]:
        if prompt is None or len(self.running_replicas()) == 1:
            return ()
        try:
            _, ids = self._inputs.encode_prompt("routing", prompt)
        except (LoomError, TypeError, ValueError):
            return ()  # the replica refuses it with the engine's message
        return prefix_hashes(ids, self._config.block_size)

    async def _route(self, named: str | None, prompt: Any = None) -> Route:
        holder = await self.pins.lookup(named) if named is not None else None
        key = _affinity()
        if holder is None and key is not None:
            holder = await self.pins.lookup(key)
        return Route(request=named, holder=holder,
                     prefix=() if holder is not None else self._prefix(prompt),
                     avoid=tuple(self.pins.known_gone()))

    async def _pin_result(self, named: str | None, route: Route, replica: str) -> None:
        """After a call served by `replica`: its pin is written (or moved)."""
        if named is not None:
            self._remember(named, replica)
            if route.holder != replica:  # moved, or first seen (restored from the store)
                await self.pins.pin(named, replica)
        key = _affinity()
        if key is not None and route.holder is None:
            await self.pins.pin(key, replica)

    async def _pin_new(self, request_id: str, replica: str, route: Route | None = None) -> None:
        """A call created `request_id` on `replica`: remember and pin it (and, for a new
        request routed with `route`, its scope's affinity key if that had no pin yet)."""
        self._remember(request_id, replica)
        await self.pins.pin(request_id, replica)
        if route is not None:
            await self._pin_result(None, route, replica)

    # ---- calls ---------------------------------------------------------------------------

    async def _call(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                    *, named: str | None = None, prompt: Any = None,
                    route: Route | None = None) -> Served:
        """One replica call, retried once elsewhere if its replica is dead; the `Served`
        answer (its error re-raised)."""
        if self._closed is not None:
            raise self._closed
        route = route or await self._route(named, prompt)
        method = self._calls
        for attempt in range(2):
            try:
                served: Served = await method.remote(op, args, kwargs, route=route)
            except _dead_replica_errors() as error:
                dead = route.replica or route.holder
                if dead is not None:
                    await self.pins.mark_gone(dead, f"its actor died: {type(error).__name__}")
                if attempt or route.replica is not None:
                    raise ReplicaUnavailableError(
                        f"no replica could take {op} for {named!r}: {error}") from None
                route = replace(route, avoid=tuple(self.pins.known_gone()))
                continue
            if (served.draining and isinstance(served.error, ReplicaUnavailableError)
                    and route.replica is None and not attempt):
                await self.pins.mark_gone(served.replica, "draining")
                route = replace(route, avoid=tuple(self.pins.known_gone()))
                continue  # refused by a draining replica: once more, elsewhere
            if served.error is not None:
                raise served.error
            return served
        raise AssertionError("unreachable")

    async def _named_call(self, op: str, request_id: str, *args: Any, **kwargs: Any) -> Any:
        route = await self._route(request_id)
        served = await self._call(op, (request_id, *args), kwargs, named=request_id,
                                  route=route)
        await self._pin_result(request_id, route, served.replica)
        return served.value

    async def add_request(self, request_id: str, prompt: str | Sequence[int],
                          sampling_params: SamplingParams | None = None,
                          **kwargs: Any) -> None:
        route = await self._route(None, prompt)
        route = replace(route, request=request_id)
        served = await self._call("add_request", (request_id, prompt, sampling_params),
                                  kwargs, named=request_id, route=route)
        await self._pin_new(request_id, served.replica, route)

    async def holds(self, request_id: str) -> bool:
        """Whether a replica holds the id; one pinned to a gone replica that no store can
        bring back is lost (`SessionLostError`, every time: the pin stays on the gone
        replica, so the cause stays known)."""
        route = await self._route(request_id)
        served = await self._call("holds", (request_id,), None, named=request_id, route=route)
        if served.value:
            await self._pin_result(request_id, route, served.replica)
            return True
        if route.holder is not None and route.holder != served.replica \
                and self._session_store is None:
            raise SessionLostError(
                f"session {request_id!r} lived on replica {route.holder}, which is gone, "
                "and no shared store keeps sessions")
        return False

    async def append(self, request_id: str, fragment: str | Sequence[int],
                     sampling_params: SamplingParams | None = None, **kwargs: Any) -> int:
        return await self._named_call("append", request_id, fragment, sampling_params, **kwargs)

    async def start_segment(self, request_id: str, params: SamplingParams,
                            fragment: str | Sequence[int] | None = None, heal: bool = False,
                            budget: TokenBudget | None = None) -> SessionView:
        return await self._named_call("start_segment", request_id, params, fragment,
                                      heal=heal, budget=budget)

    async def fork_session(self, request_id: str, new_id: str, num_tokens: int | None = None,
                           **kwargs: Any) -> int:
        route = await self._route(request_id)
        served = await self._call("fork_session", (request_id, new_id, num_tokens), kwargs,
                                  named=request_id, route=route)
        await self._pin_result(request_id, route, served.replica)
        await self._pin_new(new_id, served.replica)
        return served.value

    async def resample(self, request_id: str, sampling_params: SamplingParams | None = None,
                       n: int = 1) -> list[Sample]:
        return await self._named_call("resample", request_id, sampling_params, n)

    async def rewind(self, request_id: str, num_tokens: int) -> None:
        await self._named_call("rewind", request_id, num_tokens)

    async def get_session(self, request_id: str) -> SessionView:
        return await self._named_call("get_session", request_id)

    async def stop_generation(self, request_id: str) -> bool:
        return await self._named_call("stop_generation", request_id)

    async def save_session(self, request_id: str) -> SessionSnapshot:
        return await self._named_call("save_session", request_id)

    async def restore_session(self, snapshot: SessionSnapshot | bytes | str,
                              session_id: str | None = None) -> str:
        target = session_id or (snapshot if isinstance(snapshot, str) else None)
        route = await self._route(target)
        served = await self._call("restore_session", (snapshot, session_id), None,
                                  named=target, route=route)
        await self._pin_new(served.value, served.replica)
        return served.value

    async def close(self, request_id: str) -> None:
        try:
            await self._named_call("close", request_id)
        finally:
            await self.pins.unpin(request_id)

    async def abort(self, request_id: str) -> None:
        try:
            await self._named_call("abort", request_id)
        finally:
            await self.pins.unpin(request_id)

    async def embed(self, prompt: str | Sequence[int],
                    pooling_params: PoolingParams | None = None,
                    request_id: str | None = None) -> EmbeddingRequestOutput:
        request_id = request_id or f"embd-ray-{next(_ids)}"
        route = replace(await self._route(None, prompt), request=request_id)
        served = await self._call("embed", (prompt, pooling_params, request_id), None,
                                  route=route)
        self._remember(request_id, served.replica)
        return served.value

    # ---- streams -------------------------------------------------------------------------

    async def _stream(self, op: str, args: tuple[Any, ...], route: Route,
                      named: str | None) -> AsyncIterator[Served]:
        """A replica stream: its `Served` items (the first: the opening), errors raised;
        a replica dying under it ends it with `ReplicaUnavailableError`."""
        if self._closed is not None:
            raise self._closed
        stream = self._streams.remote(op, args, None, route=route)
        try:
            async for served in stream:
                if served.error is not None:
                    raise served.error
                yield served
        except _dead_replica_errors() as error:
            dead = self.replica_of(named) if named else None
            if dead is not None:
                await self.pins.mark_gone(dead, f"its actor died: {type(error).__name__}")
            raise ReplicaUnavailableError(
                f"the replica serving {named!r} is gone ({type(error).__name__}); its "
                "output stream ended") from None
        finally:
            stream.cancel()

    async def outputs(self, request_id: str) -> AsyncIterator[RequestOutput]:
        route = await self._route(request_id)
        source = self._stream("outputs", (request_id,), route, request_id)
        async with contextlib.aclosing(source):
            async for served in source:
                if served.value is None:  # the opening
                    await self._pin_result(request_id, route, served.replica)
                    continue
                yield served.value

    async def generate(self, prompt: str | Sequence[int],
                       sampling_params: SamplingParams | PoolingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        request_id = request_id or f"gen-ray-{next(_ids)}"
        route = replace(await self._route(None, prompt), request=request_id)
        source = self._stream("generate", (prompt, sampling_params, request_id), route,
                              request_id)
        finished = False
        try:
            async with contextlib.aclosing(source):
                async for served in source:
                    if served.value is None:  # opened: pin it (and the affinity key)
                        await self._pin_new(request_id, served.replica, route)
                        continue
                    yield served.value
                    if served.value.finished:
                        finished = True
                        return
        finally:
            if not finished and self.pins.cached(request_id) is not None:
                with contextlib.suppress(LoomError, *_dead_replica_errors()):
                    await asyncio.shield(self.abort(request_id))
            with contextlib.suppress(Exception):
                await self.pins.unpin(request_id)

    # ---- the replicas --------------------------------------------------------------------

    async def readings(self) -> list[Any]:
        """One reading per running replica (each labelled with its replica id); a replica
        that cannot answer (dying) is left out."""

        async def one(replica: str) -> list[Any]:
            try:
                served = await self._call("readings", (), None, route=Route(replica=replica))
            except (LoomError, *_dead_replica_errors()):
                return []
            return list(served.value)

        found = await asyncio.gather(*(one(r) for r in sorted(self.running_replicas())))
        return [reading for part in found for reading in part]

    async def drain_replica(self, replica: str) -> list[str]:
        """Drain one replica (see `EngineReplica`): its generating sessions' segments end
        (their readers get final outputs), plain requests are aborted, it refuses new
        work and is marked gone. Returns the ids whose segments were stopped."""
        served = await self._call("drain", (), None, route=Route(replica=replica))
        await self.pins.mark_gone(replica, "drained")
        return served.value

    def shutdown(self) -> None:
        """Delete the deployment (and stop Ray if `start_replicas` started it); later calls
        raise `EngineShutDownError`."""
        if self._closed is not None:
            return
        self._closed = EngineShutDownError("the engine replicas were shut down")
        if self._on_shutdown is not None:
            self._on_shutdown()
