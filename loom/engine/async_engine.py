"""`AsyncLLMEngine`: the engine loop in the background, per-request output queues, sessions.

One asyncio lock orders everything that touches the engine: a step (run in a worker thread
so the event loop stays responsive) and every caller operation between steps. The lock is
FIFO, so concurrent operations on one session apply in call order and none is dropped.

Every step runs on the same single worker thread. OpenMP (torch's CPU ops and Loom's
kernels) keeps one thread team per calling thread, and idle teams spin for a while after each
parallel region: steps spread over a pool of workers (`asyncio.to_thread`) left up to four
teams spinning against the one computing, which made a batched decode step under `loom
serve` about 1.4x slower than the same step offline on a 2-core host.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from loom.engine.config import EngineArgs, EngineConfig
from loom.engine.engine_observer import EngineObserver
from loom.engine.hooks import PendingCall
from loom.engine.input_processor import InputProcessor
from loom.engine.llm_engine import LLMEngine
from loom.engine.outputs import OutputAccumulator, RequestOutput
from loom.engine.pooling import EmbeddingOutput, EmbeddingRequestOutput
from loom.engine.readings import EngineReading, read_engine
from loom.engine.session_snapshot import SessionSnapshot
from loom.engine.session_store import SessionStore
from loom.engine.sessions import Sample, SessionView
from loom.engine.token_budget import TokenBudget
from loom.errors import (
    EngineShutDownError,
    LoomError,
    SessionClosedError,
    UnknownRequestError,
)
from loom.pooling_params import PoolingParams
from loom.sampling_params import RequestOutputKind, SamplingParams
from loom.tokenizer import Tokenizer

_ids = itertools.count()


class AsyncLLMEngine:
    """Coroutine versions of the engine's methods, with a background stepping loop: the
    in-process `EngineClient` (`loom/engine/client.py`). `replica` names it in readings
    ("" for a server's one engine; a Ray replica's id behind Ray Serve). Generation is
    counted from construction by an `EngineObserver` (`observe=False`: not counted), which
    leaves the engine with this object."""

    def __init__(self, engine: LLMEngine, *, observe: bool = True, replica: str = "") -> None:
        self.engine = engine
        self.replica = replica
        self.observer = EngineObserver(engine) if observe else None
        if self.observer is not None:
            weakref.finalize(self, self.observer.detach)
        # Hooks' async calls (tool calls and the like) run on this event loop, not in a step.
        engine.run_async_calls_inline = False
        self._calls: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._step_waiters: list[asyncio.Future[list[RequestOutput]]] = []
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-step")
        # Called with the id of every request the engine ended by itself (an expired session).
        self.on_ended: list[Callable[[str], None]] = []
        # A session restored from a KV store (on its first use by id) gets its queue.
        engine.table.on_session_restored.append(self._open_queue)
        # Set by `shutdown`: why every later call is refused.
        self._closed: EngineShutDownError | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLMEngine:
        """Build the synchronous engine and wrap it."""
        return cls(LLMEngine.from_engine_args(args))

    def shutdown(self) -> None:
        """Release the engine (tensor-parallel workers included): a step in flight finishes
        first; every caller still waiting for outputs gets an `EngineShutDownError`, and
        later calls are refused with it. Safe after the event loop has stopped (the
        server's shutdown) and from a coroutine on it."""
        if self._closed is not None:
            return
        closed = self._closed = EngineShutDownError("the engine was shut down")
        task = self._loop_task
        loop = task.get_loop() if task is not None else None
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        self._step_thread.shutdown(wait=True)

        def end() -> None:
            if task is not None and not task.done():
                task.cancel()
            self._fail_all(closed)
            self._queues.clear()

        if loop is not None and loop is not here and loop.is_running():
            loop.call_soon_threadsafe(end)  # the waiters live on that loop
        else:
            end()
        self.engine.shutdown()

    # ---- background loop ------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())
        self._wakeup.set()

    async def _run_loop(self) -> None:
        while self._closed is None:
            if not self.engine.has_unfinished_requests() and not self._step_waiters:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                async with self._lock:
                    outputs = await asyncio.get_running_loop().run_in_executor(
                        self._step_thread, self.engine.step)
            except Exception as exc:  # deliver to everyone waiting, keep the loop alive
                self._fail_all(exc)
                continue
            self._dispatch(outputs)
            self._drop_ended_queues()
            for call in self.engine.take_pending_calls():
                task = asyncio.get_running_loop().create_task(self._run_call(call))
                self._calls.add(task)
                task.add_done_callback(self._calls.discard)
            await asyncio.sleep(0)

    async def _run_call(self, call: PendingCall) -> None:
        """Run a hook's async call, then append its result under the lock."""
        try:
            result = await call.fn()
        except Exception as exc:  # only this request fails: abort it, report to its caller
            group = self.engine.group_of(call.seq_id)
            if group is not None:
                queue = self._queues.get(group)
                if queue is not None:
                    queue.put_nowait(exc)
                await self._call(self.engine.abort_request, group)
            return
        await self._call(self.engine.finish_pending_call, call, result)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        waiters, self._step_waiters = self._step_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(outputs)

    def _open_queue(self, request_id: str) -> None:
        """Give a request the engine has just created its output queue. Called under the
        lock, in the same engine call that created it: a queue exists exactly while its
        request is live (and until its end is delivered), so the step after a creation can
        never take it for an ended request's. A queue left by an earlier request of this id
        (the engine refuses a live id, so it has ended) gets its end first."""
        self._end_queue(request_id, UnknownRequestError(f"request {request_id!r} has ended"))
        self._queues[request_id] = asyncio.Queue()

    def _opening(self, fn: Callable[..., Any], request_id: str) -> Callable[..., Any]:
        """`fn`, an engine call that creates request `request_id`, followed by its queue."""

        def run(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            self._open_queue(request_id)
            return result

        return run

    def _drop_ended_queues(self) -> None:
        """Forget the queues of requests the engine ended by itself (an expired session):
        a caller still waiting on one gets the reason instead of waiting forever."""
        engine = self.engine
        ended = [rid for rid in self._queues if not engine.is_live(rid)]
        for request_id in ended:
            queue = self._queues.pop(request_id)
            reason = engine.ended_reason(request_id)
            if reason in ("expired", "closed"):
                queue.put_nowait(SessionClosedError(f"session {request_id!r} is {reason}"))
            for listener in self.on_ended:
                listener(request_id)

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(exc)
        waiters, self._step_waiters = self._step_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_exception(exc)

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._closed is not None:
            raise self._closed
        async with self._lock:
            try:
                result = fn(*args, **kwargs)
            finally:  # the store never lags what the caller is answered
                self.engine.persist_sessions()
        self._ensure_loop()
        return result

    # ---- facts and lookups (no lock: they read, between steps or not) -------------

    @property
    def tokenizer(self) -> Tokenizer:
        """The engine's tokenizer."""
        return self.engine.tokenizer

    @property
    def inputs(self) -> InputProcessor:
        """The engine's input processor (tokenisation and validation, as the engine does)."""
        return self.engine.inputs

    @property
    def config(self) -> EngineConfig:
        """The engine's resolved configuration."""
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        """The context limit in tokens."""
        return self.engine.config.max_model_len

    @property
    def session_store(self) -> SessionStore | None:
        """Where sessions are kept beside their KV blocks (None without a KV store)."""
        return self.engine.session_store

    def is_live(self, request_id: str) -> bool:
        """Whether a request or session by this id is live (paused sessions included)."""
        return self.engine.is_live(request_id)

    async def holds(self, request_id: str) -> bool:
        """`is_live`, as the engine-client protocol asks it."""
        return self.engine.is_live(request_id)

    async def live_request_ids(self) -> list[str]:
        """The ids of every live request and session (read under the lock: a step running
        on the worker thread changes them)."""
        return await self._call(self.engine.table.group_ids)

    async def readings(self) -> list[EngineReading]:
        """This engine's reading (read without the lock: see `loom/engine/readings.py`)."""
        observed = self.observer.counts() if self.observer is not None else None
        return [EngineReading(self.replica, read_engine(self.engine), observed)]

    def check_pooling_params(self, params: PoolingParams) -> None:
        """An `InvalidRequestError` naming `dimensions` when the model does not take them."""
        self.engine.check_pooling_params(params)

    def embedding_dimensions(self) -> list[int]:
        """The values `PoolingParams.dimensions` may take on this model."""
        return self.engine.embedding_dimensions()

    # ---- the engine's API as coroutines -------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> None:
        """Queue a request or open a session (`session=True`); its output queue opens with it
        (a refused one, a duplicate id included, changes no queue)."""
        await self._call(self._opening(self.engine.add_request, request_id), request_id,
                         prompt, sampling_params, **kwargs)

    async def fork_session(self, request_id: str, new_id: str, num_tokens: int | None = None,
                           **kwargs: Any) -> int:
        """Open session `new_id` from a paused session's first tokens, sharing its blocks
        (see `LLMEngine.fork_session`); returns the tokens whose K/V it shares. Its output
        queue opens with it."""
        return await self._call(self._opening(self.engine.fork_session, new_id), request_id,
                                new_id, num_tokens, **kwargs)

    async def step(self) -> list[RequestOutput]:
        """The outputs of the next engine step."""
        fut: asyncio.Future[list[RequestOutput]] = asyncio.get_running_loop().create_future()
        self._step_waiters.append(fut)
        self._ensure_loop()
        return await fut

    async def prefill(
        self,
        request_id: str | Sequence[int] | None = None,
        fragment: str | Sequence[int] | None = None,
        sampling_params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> int:
        """Append a fragment to a live request or session (see `LLMEngine.prefill`);
        `prefill(fragment)`, without an id, addresses the one live request (resolved under
        the lock, when the call runs); `append` is the same call."""
        if fragment is None:  # prefill(fragment): the one argument is the fragment
            request_id, fragment = None, request_id

        def run() -> int:
            rid = self.engine.only_live_request() if request_id is None else request_id
            fn = self.engine.append if sampling_params is None \
                else self._drained(self.engine.append)
            return fn(rid, fragment, sampling_params, **kwargs)

        return await self._call(run)

    append = prefill

    async def resume(self, request_id: str, sampling_params: SamplingParams) -> None:
        """Start a new generation segment on a paused session."""
        await self._call(self._drained(self.engine.resume), request_id, sampling_params)

    async def start_segment(
        self,
        request_id: str,
        params: SamplingParams,
        fragment: str | Sequence[int] | None = None,
        heal: bool = False,
        budget: TokenBudget | None = None,
    ) -> SessionView:
        """Append `fragment` (if given) to a paused session and start a generation segment
        after it, in one engine call (`SessionManager.append` with parameters, or `resume`):
        every check, the budget's included (`TokenBudget`: the segment's max_tokens for the
        session's length after the fragment), comes before anything changes; a generating
        session is refused. Returns the session as the segment starts from."""

        def run() -> SessionView:
            sessions = self.engine.sessions
            sessions.require_paused(request_id, "start a segment on")
            self._drop_queued(request_id)
            if fragment is None:
                sessions.resume(request_id, params, budget)
            else:
                sessions.append(request_id, fragment, params, heal=heal, budget=budget)
            return sessions.get_session(request_id)

        return await self._call(run)

    def _drop_queued(self, request_id: str) -> None:
        """Drop a request's queued outputs of earlier segments (a new segment starts)."""
        queue = self._queues.get(request_id)
        while queue is not None and not queue.empty():
            queue.get_nowait()

    def _drained(self, fn: Any) -> Any:
        """`fn` preceded by dropping the request's queued outputs of earlier segments."""

        def run(request_id: str, *args: Any, **kwargs: Any) -> Any:
            self._drop_queued(request_id)
            return fn(request_id, *args, **kwargs)

        return run

    async def resample(self, request_id: str, *a: Any, **k: Any) -> list[Sample]:
        """Draw tokens from the stored logits of a session, or of a plain request after a
        fragment appended to it (waits until they are computed)."""
        await self.wait_for_logits(request_id)
        return await self._call(self.engine.resample, request_id, *a, **k)

    async def get_logits(self, request_id: str) -> torch.Tensor:
        """A session's stored logits row (waits until it is computed)."""
        await self.wait_for_logits(request_id)
        return await self._call(self.engine.get_logits, request_id)

    async def wait_for_logits(self, request_id: str) -> None:
        """Return once logits to draw from are stored: a session paused with every token
        computed, or a plain request whose appended fragment was computed."""
        while True:
            async with self._lock:
                if self.engine.has_logits(request_id):
                    return
                if not self.engine.logits_pending(request_id):
                    # Nothing will compute them (a session at the context limit, a plain
                    # request without a fragment).
                    self.engine.resample(request_id)  # raises the engine's clear error
            await self.step()

    async def rewind(self, request_id: str, num_tokens: int) -> None:
        """Drop the last tokens of a paused session."""
        await self._call(self.engine.rewind, request_id, num_tokens)

    async def get_session(self, request_id: str) -> SessionView:
        """A snapshot of a session."""
        return await self._call(self.engine.get_session, request_id)

    async def stop_generation(self, request_id: str) -> bool:
        """End a session's generation segment now (its caller went away); it stays open."""
        return await self._call(self.engine.stop_generation, request_id)

    async def save_session(self, request_id: str) -> SessionSnapshot:
        """`LLMEngine.save_session`."""
        return await self._call(self.engine.save_session, request_id)

    async def restore_session(self, snapshot: SessionSnapshot | bytes | str,
                              session_id: str | None = None) -> str:
        """`LLMEngine.restore_session`."""
        return await self._call(self.engine.restore_session, snapshot, session_id)

    async def close(self, request_id: str) -> None:
        """Close a session and free its blocks; a caller still reading its outputs (a
        segment streaming) gets `SessionClosedError` instead of waiting forever."""
        await self._call(self.engine.close, request_id)
        self._end_queue(request_id, SessionClosedError(f"session {request_id!r} is closed"))

    async def abort(self, request_id: str) -> None:
        """Abort a request or session; a caller still reading its outputs gets
        `UnknownRequestError` (it has been aborted) instead of waiting forever."""
        await self._call(self.engine.abort_request, request_id)
        self._end_queue(request_id,
                        UnknownRequestError(f"request {request_id!r} has already aborted"))

    def _end_queue(self, request_id: str, reason: LoomError) -> None:
        """Drop a request's output queue, leaving `reason` for whoever still waits on it."""
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(reason)

    async def outputs(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Every output of a request as it arrives, until it (or its segment) finishes; an
        error for an id that has no outputs to wait for (unknown, or already ended)."""
        queue = self._queues.get(request_id)
        if queue is None:
            if self._closed is not None:
                raise self._closed
            reason = self.engine.ended_reason(request_id)
            raise UnknownRequestError(f"request {request_id!r} has no outputs to wait for"
                                      + (f": it has {reason}" if reason else ""))
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished or item.segment_finished:
                return

    async def generate(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's streaming API: yields the request's cumulative output after every step
        (with `PoolingParams`, its one `EmbeddingRequestOutput`)."""
        request_id = request_id or f"gen-{next(_ids)}"
        await self.add_request(request_id, prompt, sampling_params)
        try:
            async for out in self.outputs(request_id):
                yield out
                if out.finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if self.engine.is_live(request_id):
                # Shielded: a consumer cancelled twice (a server's disconnect handling) must
                # not cancel the abort that frees the request's KV.
                await asyncio.shield(self.abort(request_id))

    async def embed(self, prompt: str | Sequence[int], pooling_params: PoolingParams | None = None,
                    request_id: str | None = None) -> EmbeddingRequestOutput:
        """An embedding request's one output (its pooled final hidden state); one that the
        engine failed has an empty embedding and its `error`. Cancelled, it is aborted."""
        request_id = request_id or f"embd-{next(_ids)}"
        outputs = self.generate(prompt, pooling_params or PoolingParams(), request_id)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                if isinstance(out, EmbeddingRequestOutput):
                    return out
                return EmbeddingRequestOutput(  # an error output: the engine failed it
                    request_id=request_id, outputs=EmbeddingOutput([]),
                    prompt_token_ids=out.prompt_token_ids, prompt=out.prompt,
                    error=out.error or "the request failed")
        raise AssertionError(f"request {request_id!r} ended without an output")

    def session(self, prompt: str | Sequence[int], **kwargs: Any) -> Session:
        """`async with engine.session(prompt) as s:` opens a paused session, closes it at exit."""
        return Session(self, prompt, **kwargs)


@dataclass
class SegmentOutput:
    """What one `Session.generate` produced."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    output: RequestOutput


class Session:
    """A live session: `await s.append(text)`, `await s.generate(params)`, `await s.resample()`."""

    def __init__(self, engine: AsyncLLMEngine, prompt: str | Sequence[int], **kwargs: Any):
        self.engine = engine
        self.prompt = prompt
        self.request_id: str = kwargs.pop("request_id", None) or f"session-{next(_ids)}"
        self._kwargs = kwargs

    async def __aenter__(self) -> Session:
        await self.engine.add_request(
            self.request_id, self.prompt, None, session=True, **self._kwargs
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.engine.is_live(self.request_id):
            await self.engine.close(self.request_id)

    async def prefill(self, fragment: str | Sequence[int], **kwargs: Any) -> int:
        """Append a fragment (computed by the next steps); returns its token count. `append`
        is the same call."""
        return await self.engine.prefill(self.request_id, fragment, **kwargs)

    append = prefill

    async def generate(self, sampling_params: SamplingParams) -> SegmentOutput:
        """Generate one segment and wait for it to end: exactly the tokens it produced."""
        params = sampling_params.with_updates(output_kind=RequestOutputKind.DELTA)
        await self.engine.resume(self.request_id, params)
        gathered = OutputAccumulator()
        async for out in self.engine.outputs(self.request_id):
            gathered.add(out)
        last = gathered.result()
        completion = last.outputs[0]
        return SegmentOutput(
            text=completion.text,
            token_ids=completion.token_ids,
            finish_reason=completion.finish_reason,
            output=last,
        )

    async def resample(
        self, sampling_params: SamplingParams | None = None, n: int = 1
    ) -> list[Sample]:
        """Draw tokens from the stored logits."""
        return await self.engine.resample(self.request_id, sampling_params, n)

    async def rewind(self, num_tokens: int) -> None:
        """Drop the last tokens."""
        await self.engine.rewind(self.request_id, num_tokens)

    async def view(self) -> SessionView:
        """A snapshot of the session."""
        return await self.engine.get_session(self.request_id)
