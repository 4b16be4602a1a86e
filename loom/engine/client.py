"""`EngineClient`: the one protocol between a server and the engines behind it.

`loom serve` (the OpenAI routes, the session and response services, the metrics) talks to
an engine client and to nothing else of an engine. Two clients implement it:

- in process: `AsyncLLMEngine` (`loom/engine/async_engine.py`), one engine in the server's
  process, its steps on a worker thread;
- over Ray Serve: `RayEngineClient` (`loom/distributed/ray_client.py`), N engine replicas
  (each an `AsyncLLMEngine`) behind deployment handles, every call that names a request or
  session routed to the replica that holds it.

The messages are plain, picklable values: token ids or text, `SamplingParams`,
`PoolingParams`, `TokenBudget`, `SessionView`, `Sample`, `RequestOutput`, `SessionSnapshot`,
`EngineReading`, and `LoomError`s (with the `param` they name). The engine validates its own
limits (`TokenBudget` under its lock), so no caller code ever runs inside an engine call.
What a server reads locally, without a round trip, is the model's facts: its tokenizer and
input processor (tokenisation and validation by the engine's own rules), its resolved
config, its context limit, and the session store where sessions and records are kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from loom.engine.config import EngineConfig
    from loom.engine.input_processor import InputProcessor
    from loom.engine.outputs import RequestOutput
    from loom.engine.pooling import EmbeddingRequestOutput
    from loom.engine.readings import EngineReading
    from loom.engine.session_snapshot import SessionSnapshot
    from loom.engine.session_store import SessionStore
    from loom.engine.sessions import Sample, SessionView
    from loom.engine.token_budget import TokenBudget
    from loom.pooling_params import PoolingParams
    from loom.sampling_params import SamplingParams
    from loom.tokenizer import Tokenizer


@dataclass
class CallScope:
    """What the engine calls made in one context (one HTTP request, say) share: an affinity
    key (new requests made under one key reach the engine the key is pinned to, where there
    are several, as a session's calls do: vLLM's and Ray Serve's `x-session-id`), and the
    replicas that served them, in order (a server names the last in a response header).
    One engine in process serves everything and notes nothing."""

    affinity: str | None = None
    served: list[str] = field(default_factory=list)

    def note_served(self, replica: str) -> None:
        """A call of this scope was served by `replica`."""
        if not self.served or self.served[-1] != replica:
            self.served.append(replica)


_scope: ContextVar[CallScope | None] = ContextVar("loom_call_scope", default=None)


@contextlib.contextmanager
def call_scope(affinity: str | None = None) -> Iterator[CallScope]:
    """The calls made inside (and in tasks started inside) share a new `CallScope`."""
    scope = CallScope(affinity)
    token = _scope.set(scope)
    try:
        yield scope
    finally:
        _scope.reset(token)


def current_scope() -> CallScope | None:
    """The `CallScope` of the calls made here (None outside any)."""
    return _scope.get()


@runtime_checkable
class EngineClient(Protocol):
    """What a server may ask of the engines behind it (see the module docstring). Every
    coroutine raises `LoomError`s: `UnknownRequestError` (or `SessionLostError`, whose
    replica is gone) for an id no engine holds, `InvalidSessionStateError` for an operation
    the session's state refuses, `InvalidRequestError` (with `param`) for bad input,
    `EngineShutDownError` once shut down."""

    # ---- the model's facts, read locally -------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def inputs(self) -> InputProcessor: ...

    @property
    def config(self) -> EngineConfig: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def session_store(self) -> SessionStore | None: ...

    # Called with the id of every request an engine ended by itself (an expired session).
    on_ended: list[Callable[[str], None]]

    # ---- requests and sessions ---------------------------------------------------------

    async def add_request(self, request_id: str, prompt: str | Sequence[int],
                          sampling_params: SamplingParams | None = None,
                          **kwargs: Any) -> None:
        """Queue a request, or open a session with `session=True` (`pin`, `ttl_s`,
        `priority` as `LLMEngine.add_request` takes them); its output stream opens with it."""
        ...

    async def holds(self, request_id: str) -> bool:
        """Whether a live request or session by this id exists (a paused one included; one
        kept in the session store is restored by the first operation that names it)."""
        ...

    async def append(self, request_id: str, fragment: str | Sequence[int],
                     sampling_params: SamplingParams | None = None, **kwargs: Any) -> int:
        """Append a fragment to a live request or session (`heal=True` re-tokenises across
        the boundary); returns the number of tokens appended."""
        ...

    async def start_segment(self, request_id: str, params: SamplingParams,
                            fragment: str | Sequence[int] | None = None, heal: bool = False,
                            budget: TokenBudget | None = None) -> SessionView:
        """Append `fragment` (if given) to a paused session and start a generation segment
        after it, in one engine call. With `budget`, the segment's `max_tokens` is the
        budget resolved for the session's length after the fragment. Every refusal comes
        before anything changes. Returns the session as the segment starts from."""
        ...

    async def fork_session(self, request_id: str, new_id: str, num_tokens: int | None = None,
                           **kwargs: Any) -> int:
        """Open session `new_id` from a paused session's first `num_tokens` tokens, sharing
        their K/V; returns how many it shares."""
        ...

    async def resample(self, request_id: str, sampling_params: SamplingParams | None = None,
                       n: int = 1) -> list[Sample]:
        """Draw `n` tokens from a session's stored logits (waits until they are computed)."""
        ...

    async def rewind(self, request_id: str, num_tokens: int) -> None:
        """Drop the last `num_tokens` tokens of a paused session."""
        ...

    async def get_session(self, request_id: str) -> SessionView:
        """A snapshot of a session."""
        ...

    async def stop_generation(self, request_id: str) -> bool:
        """End a session's generation segment now (it stays, paused); False if none ran."""
        ...

    async def save_session(self, request_id: str) -> SessionSnapshot:
        """A paused session's snapshot (its K/V stays in the engine or the KV store)."""
        ...

    async def restore_session(self, snapshot: SessionSnapshot | bytes | str,
                              session_id: str | None = None) -> str:
        """Open a session from a snapshot (or the id of one kept in the session store)."""
        ...

    async def close(self, request_id: str) -> None:
        """Close a session and free its K/V; a reader of its outputs gets an error."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort a request or session; a reader of its outputs gets an error."""
        ...

    def outputs(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """A live request's outputs as they come, until it (or its segment) finishes."""
        ...

    def generate(self, prompt: str | Sequence[int],
                 sampling_params: SamplingParams | PoolingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes; aborted if the iteration
        stops early."""
        ...

    async def embed(self, prompt: str | Sequence[int],
                    pooling_params: PoolingParams | None = None,
                    request_id: str | None = None) -> EmbeddingRequestOutput:
        """An embedding request's one output."""
        ...

    def check_pooling_params(self, params: PoolingParams) -> None:
        """An `InvalidRequestError` naming `dimensions` when the model does not take them
        (a fact of the model, checked locally)."""
        ...

    # ---- what the engines are doing -----------------------------------------------------

    async def readings(self) -> list[EngineReading]:
        """One reading per engine (its state, counters and observed generation), for
        `/metrics`: one for an in-process engine, one per replica behind Ray."""
        ...

    def shutdown(self) -> None:
        """Release the engines; later calls raise `EngineShutDownError`."""
        ...
