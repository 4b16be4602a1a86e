"""`LLMEngine`: the synchronous engine's public API over the engine core.

    LLMEngine  -- InputProcessor   prompts and fragments -> validated token ids
               -- EngineCore       scheduler + executor + sequence table; step()
               -- SessionManager   append / resume / resample / rewind / close, via the table

Every public method validates its input first and changes nothing when it refuses it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loom.core.request import RequestStatus
from loom.core.scheduler import Scheduler
from loom.core.scheduler_output import SchedulerOutput
from loom.engine.calibration import calibrate_step_cost
from loom.engine.config import EngineArgs, EngineConfig
from loom.engine.engine_core import EngineCore
from loom.engine.hooks import HookContext, PendingCall, SequenceHook
from loom.engine.input_processor import InputProcessor
from loom.engine.kv_events import KVEventStream, create_kv_event_stream
from loom.engine.outputs import fill_decoded_tokens
from loom.engine.pooling import EngineOutput, check_dimensions
from loom.engine.promise_sync import PromiseSyncHook
from loom.engine.resolve import build_engine_parts
from loom.engine.session_snapshot import SessionSnapshot
from loom.engine.session_store import PersistedSessions, SessionStore
from loom.engine.sessions import Sample, SessionManager, SessionView
from loom.engine.speculation import Speculator
from loom.engine.stats import EngineLoad, EngineStats, StepTimes, read_load
from loom.engine.structured_output import StructuredOutputs
from loom.errors import InvalidRequestError, UnknownRequestError
from loom.kv_connector import KVConnectorRole, create_connector
from loom.parallel.executor import TensorParallelExecutor
from loom.pooling_params import PoolingParams
from loom.runner.executor import Executor
from loom.runner.model_runner import ModelRunner
from loom.sampling_params import SamplingParams
from loom.tokenizer import Tokenizer


class LLMEngine:
    """The synchronous engine: add requests and sessions, `step()`, read outputs.

    Request ids name what a caller added; with `n > 1` each of the n sequences is scheduled
    as its own `Request` ("id/0", "id/1", ...) and their outputs are gathered under the id.
    """

    def __init__(self, config: EngineConfig, executor: Executor, tokenizer: Tokenizer) -> None:
        """`executor`: a `ModelRunner` (one device) or a `TensorParallelExecutor`."""
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.kv_connector = None
        if config.kv_transfer is not None:
            self.kv_connector = create_connector(
                config.kv_transfer, config.kv_cache_spec, KVConnectorRole.SCHEDULER
            )
        self.scheduler = Scheduler(config.scheduler, self.kv_connector)
        # KV cache events for KV-aware routers: opened last (after the calibration, which
        # leaves the cache empty), so a start that fails before leaves no socket bound; a
        # bad address fails the start.
        self.kv_events: KVEventStream | None = None
        self.eos_token_ids: set[int] = set(tokenizer.eos_token_ids) | set(config.eos_token_ids)
        hooks: list[SequenceHook] = list(config.hooks)
        if config.special_kwargs is not None:
            hooks.insert(
                0, PromiseSyncHook.from_kwargs(config.special_kwargs, tokenizer.token_to_id)
            )
        self.structured = StructuredOutputs(tokenizer, config.vocab_size)
        self.inputs = InputProcessor(tokenizer, config.vocab_size, config.max_model_len,
                                     structured=self.structured)
        self.core = EngineCore(
            self.scheduler, executor, tokenizer,
            device=config.device, max_model_len=config.max_model_len,
            num_kv_blocks=config.num_kv_blocks, eos_token_ids=self.eos_token_ids,
            hooks=hooks, speculative=config.speculative, structured=self.structured,
        )
        self.table = self.core.table
        self.sessions = SessionManager(
            self.table, self.inputs, self.core.appender, config.session_ttl_s
        )
        # With a KV store, sessions are kept beside their blocks and outlive the process.
        self.session_store: SessionStore | None = None
        self._persisted: PersistedSessions | None = None
        store = getattr(self.kv_connector, "store", None)
        if store is not None and config.kv_cache_spec is not None:
            self.session_store = SessionStore(
                store, config.kv_cache_spec.fingerprint, save=config.kv_transfer.is_producer,
                load=config.kv_transfer.is_consumer)
            self._persisted = PersistedSessions(self.session_store, self.sessions)
        if config.scheduler.max_step_ms is not None:  # the time budget holds from the start
            calibrate_step_cost(self)
        self.kv_events = create_kv_event_stream(config.kv_events, config.device)
        if self.kv_events is not None:
            self.scheduler.kv.attach_events(self.kv_events.collector)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """Load the model and tokenizer and size the KV pool as the arguments say."""
        config, executor, tokenizer = build_engine_parts(args)
        return cls(config, executor, tokenizer)

    @property
    def runner(self) -> ModelRunner:
        """The model runner in this process: the whole model, or rank 0's shard of it."""
        executor = self.executor
        return executor.runner if isinstance(executor, TensorParallelExecutor) else executor  # type: ignore[return-value]

    def shutdown(self) -> None:
        """Release the executor: under tensor parallelism, stop every worker process (also
        done at interpreter exit), and the KV event publisher (its sockets are closed).
        Later steps fail."""
        if self.kv_events is not None:
            self.kv_events.shutdown()
        self.executor.shutdown()

    # ---- adding and removing ------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | PoolingParams | None = None,
        *,
        session: bool = False,
        pin: bool = False,
        ttl_s: float | None = None,
    ) -> None:
        """Queue a request (or open a session with `session=True`).

        A session opened without `sampling_params` only computes its prompt and pauses with
        the last logits stored; `resume` or `append(..., sampling_params)` starts generating.
        `ttl_s` overrides the engine's `session_ttl_s` for this session. With `PoolingParams`
        it is an embedding request: its one output is an `EmbeddingRequestOutput`.
        """
        if isinstance(sampling_params, PoolingParams):
            if session:
                raise InvalidRequestError(
                    f"request {request_id!r}: an embedding request cannot be a session")
            self._add_embedding_request(request_id, prompt, sampling_params)
            return
        params = sampling_params or SamplingParams()
        if session and params.n != 1:
            raise InvalidRequestError(f"session {request_id!r}: n must be 1, got {params.n}")
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidRequestError(f"session {request_id!r}: ttl_s must be > 0, got {ttl_s}")
        self.table.check_new_id(request_id)  # before tokenising: refused as it came
        prompt_text, prompt_ids = self.inputs.encode_prompt(request_id, prompt)
        self.inputs.check_params(request_id, params)
        self.table.add_group(request_id, prompt_text, prompt_ids, params, session=session,
                             pin=pin, ttl_s=ttl_s)
        if session and sampling_params is None:
            self.table.start_segment(self.table.session(request_id), None)

    def _add_embedding_request(self, request_id: str, prompt: str | Sequence[int],
                               params: PoolingParams) -> None:
        """Queue a prompt-only request whose output is its pooled, final hidden state."""
        self.table.check_new_id(request_id)
        self.check_pooling_params(params)
        prompt_text, prompt_ids = self.inputs.encode_prompt(request_id, prompt)
        self.table.add_group(request_id, prompt_text, prompt_ids, SamplingParams(),
                             pooling=params.pooling)
        self.core.pooler.add(request_id, params)

    def check_pooling_params(self, params: PoolingParams) -> None:
        """An `InvalidRequestError` naming `dimensions` when the model does not take them."""
        check_dimensions(params, self.config.embedding_dimensions)

    def embedding_dimensions(self) -> list[int]:
        """The values `PoolingParams.dimensions` may take on this model (none unless it is
        a matryoshka model)."""
        return list(self.config.embedding_dimensions)

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        """Stop requests (or sessions) now and free their blocks; unknown ids raise."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.table.group(rid)
        for rid in ids:
            self.table.end_group(rid, "aborted", RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs (paused sessions do not count)."""
        return self.core.has_work()

    def is_live(self, request_id: str) -> bool:
        """Whether a request or session by this id is live (paused sessions included)."""
        return self.table.is_live(request_id)

    def ended_reason(self, request_id: str) -> str | None:
        """Why a recently ended request ended ("finished", "failed", "aborted", "closed",
        "expired"), or None."""
        return self.table.ended_reason(request_id)

    # ---- the step ----------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """Run one engine step and return the outputs of the requests it advanced (an
        embedding request's one output is an `EmbeddingRequestOutput`)."""
        self.sessions.expire_idle()
        outputs = self.core.step()
        if self.kv_events is not None:  # the step's cache changes, as one batch
            self.kv_events.flush()
        self.persist_sessions()
        fill_decoded_tokens(outputs, self._decode_token)
        return outputs

    def persist_sessions(self) -> None:
        """With a session store, save the sessions that parked or changed since the last
        save: every step ends with this, and so does every call that changes a session's
        tokens (append, rewind, stop), here and in the async engine."""
        if self._persisted is not None:
            self._persisted.flush()

    def _decode_token(self, token_id: int) -> str:
        """One token's text (a `Logprob`'s `decoded_token`)."""
        return self.tokenizer.decode([token_id])

    @property
    def last_scheduler_output(self) -> SchedulerOutput | None:
        """What the last step scheduled (for tests and tools)."""
        return self.core.last_scheduler_output

    @property
    def num_steps(self) -> int:
        """Steps that ran the model."""
        return self.core.num_steps

    @property
    def speculator(self) -> Speculator | None:
        """Speculative decoding's drafter and its counters (None when it is off)."""
        return self.core.speculator

    @property
    def hooks(self) -> list[SequenceHook]:
        """The sequence hooks, in the order they run (a list the caller may extend)."""
        return self.core.appender.hooks

    @property
    def hook_context(self) -> HookContext:
        """What hooks act through (warnings they counted, pending async calls)."""
        return self.core.hook_context

    @property
    def run_async_calls_inline(self) -> bool:
        """Whether `step()` runs hooks' async calls itself (the async engine turns it off)."""
        return self.core.run_async_calls_inline

    @run_async_calls_inline.setter
    def run_async_calls_inline(self, value: bool) -> None:
        self.core.run_async_calls_inline = value

    def take_pending_calls(self) -> list[PendingCall]:
        """Async calls hooks asked for since the last take (the async engine runs them)."""
        return self.core.hook_context.take_pending_calls()

    def finish_pending_call(self, call: PendingCall, result: str | Sequence[int]) -> None:
        """Append an async call's result to its sequence and let it continue."""
        self.core.hook_context.unblock(call.seq_id, result)

    def group_of(self, seq_id: str) -> str | None:
        """The request id a sequence id belongs to, or None when it is not live."""
        seq = self.table.get(seq_id)
        return None if seq is None else seq.group_id

    # ---- sessions ----------------------------------------------------------------------

    def prefill(
        self,
        request_id: str | Sequence[int] | None = None,
        fragment: str | Sequence[int] | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        heal: bool = False,
    ) -> int:
        """Append a fragment to a live request, computed by the next steps: a session (paused:
        it stays paused with new stored logits, or starts a segment with `sampling_params`;
        generating: it goes on after the fragment), or any request of one sequence, which
        goes on generating after it (see `SessionManager.append`). Returns its length.
        `prefill(fragment)`, without an id, addresses the one live request (the seed's
        call); `append` is the same call."""
        if fragment is None:  # prefill(fragment): the one argument is the fragment
            request_id, fragment = None, request_id
        if fragment is None:
            raise InvalidRequestError("prefill needs a fragment (text or token ids)")
        if request_id is None:
            request_id = self.only_live_request()
        elif not isinstance(request_id, str):
            raise InvalidRequestError(
                f"prefill(request_id, fragment): request_id must be a str, got {request_id!r}")
        appended = self.sessions.append(request_id, fragment, sampling_params, heal=heal)
        self.persist_sessions()
        return appended

    def only_live_request(self) -> str:
        """The id of the one live request or session (what `prefill(fragment)` addresses);
        an `InvalidRequestError` naming them when there are several, or none."""
        live = self.table.group_ids()
        if len(live) == 1:
            return live[0]
        if not live:
            raise InvalidRequestError(
                "prefill(fragment) without a request id needs one live request; none is live")
        shown = ", ".join(repr(r) for r in live[:10]) + (", ..." if len(live) > 10 else "")
        raise InvalidRequestError(
            f"prefill(fragment) without a request id needs one live request; {len(live)} are "
            f"live ({shown}): call prefill(request_id, fragment)")

    append = prefill

    def resume(self, request_id: str, sampling_params: SamplingParams) -> None:
        """Start a generation segment on a paused session (see `SessionManager.resume`)."""
        self.sessions.resume(request_id, sampling_params)

    def stop_generation(self, request_id: str) -> bool:
        """End a generating session's segment now; False when it was not generating."""
        stopped = self.sessions.stop_generation(request_id)
        self.persist_sessions()
        return stopped

    def resample(
        self, request_id: str, sampling_params: SamplingParams | None = None, n: int = 1
    ) -> list[Sample]:
        """Draw `n` tokens from the stored logits (a session's last position, or the end of
        a plain request's last appended fragment); the request does not change."""
        return self.sessions.resample(request_id, sampling_params, n)

    def get_logits(self, request_id: str) -> torch.Tensor:
        """The stored float32 logits row: a session's last position, or the end of a plain
        request's last appended fragment."""
        return self.sessions.get_logits(request_id)

    def has_logits(self, request_id: str) -> bool:
        """Whether stored logits can be drawn from now (see `resample`)."""
        return self.sessions.has_logits(request_id)

    def logits_pending(self, request_id: str) -> bool:
        """Whether steps will yet store logits to draw from (see `SessionManager`)."""
        return self.sessions.logits_pending(request_id)

    def rewind(self, request_id: str, num_tokens: int) -> None:
        """Drop a paused session's last `num_tokens` tokens (see `SessionManager.rewind`)."""
        self.sessions.rewind(request_id, num_tokens)
        self.persist_sessions()

    def fork_session(self, request_id: str, new_id: str, num_tokens: int | None = None, *,
                     pin: bool = False, ttl_s: float | None = None) -> int:
        """Open session `new_id` continuing the paused session `request_id` from its first
        `num_tokens` tokens, sharing its blocks copy-on-write (see `SessionManager.fork`);
        returns the tokens whose K/V it shares."""
        return self.sessions.fork(request_id, new_id, num_tokens, pin=pin, ttl_s=ttl_s)

    def get_session(self, request_id: str) -> SessionView:
        """A read-only view of a session."""
        return self.sessions.get_session(request_id)

    def close(self, request_id: str) -> None:
        """End a session and free everything it holds (its stored snapshot too)."""
        self.sessions.close(request_id)

    def save_session(self, request_id: str) -> SessionSnapshot:
        """The paused session's state (`SessionSnapshot`: tokens, stored logits, sampling
        and structured-output state; `to_bytes()` for a file), also written to the KV store
        when one is configured. Its K/V is not in it: a restore takes the blocks from the
        store where they are held and computes the rest."""
        fingerprint = self.session_store.fingerprint if self.session_store else None
        snapshot = self.sessions.snapshot(request_id, fingerprint)
        if self.session_store is not None:
            self.session_store.save(snapshot)
        return snapshot

    def restore_session(self, snapshot: SessionSnapshot | bytes | str,
                        session_id: str | None = None) -> str:
        """Open a saved session again (under `session_id`, default its own id), from a
        `SessionSnapshot`, its bytes, or (a str) the id of a session the KV store keeps. A
        snapshot with its last logits parks PAUSED at once, holding no K/V until an operation
        next wakes it (its full blocks then come from the prefix cache or the store, the rest
        is computed); without them (or with another vocabulary's row) the next steps compute
        its K/V and logits that way, then it pauses. Returns the session's id. Sessions a
        store keeps are also restored on their first use by id, so this is needed only to
        open one under another id or from bytes."""
        if isinstance(snapshot, str):
            found = self.session_store.load(snapshot) if self.session_store else None
            if found is None:
                raise UnknownRequestError(f"no stored session {snapshot!r}")
            snapshot = found
        elif isinstance(snapshot, bytes | bytearray):
            snapshot = SessionSnapshot.from_bytes(bytes(snapshot))
        self.sessions.restore(snapshot, session_id)
        return snapshot.session_id if session_id is None else session_id

    # ---- introspection -----------------------------------------------------------------

    @property
    def num_recomputed_tokens(self) -> int:
        """Tokens computed a second time (after preemption or a rewind), engine-wide."""
        return self.scheduler.num_recomputed_tokens

    @property
    def num_free_blocks(self) -> int:
        """Free blocks in the KV pool."""
        return self.scheduler.kv.num_free_blocks

    @property
    def kv_pool_all_free(self) -> bool:
        """True when no request holds any KV block (the leak check)."""
        return self.scheduler.kv.pool.all_free

    @property
    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters (steps, preemptions, KV pool, prefix cache,
        speculative decoding)."""
        kv, spec, external = self.scheduler.kv, self.core.speculator, self.scheduler.external
        return EngineStats(
            num_steps=self.core.num_steps,
            num_preemptions=self.scheduler.num_preemptions,
            num_recomputed_tokens=self.scheduler.num_recomputed_tokens,
            num_computed_tokens=self.scheduler.num_computed_tokens,
            num_kv_blocks=kv.pool.num_blocks,
            num_free_kv_blocks=kv.num_free_blocks,
            num_cached_kv_blocks=kv.pool.num_cached_blocks,
            num_evicted_kv_blocks=kv.pool.num_evictions,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            num_draft_tokens=spec.num_drafted if spec else 0,
            num_accepted_draft_tokens=spec.num_accepted if spec else 0,
            kv_loaded_tokens=external.num_loaded_tokens if external else 0,
            kv_gap_tokens=external.num_gap_tokens if external else 0,
            kv_load_failed_tokens=external.num_load_failed_tokens if external else 0,
            kv_saved_blocks=getattr(self.executor.kv_connector, "num_saved_blocks", 0),
        )

    @property
    def load(self) -> EngineLoad:
        """Sequences running, waiting, paused and blocked now, and the prompt tokens queued
        (safe to read while a step runs on another thread)."""
        scheduler = self.scheduler
        return read_load(scheduler.running, scheduler.waiting, scheduler.idle)

    @property
    def step_times(self) -> StepTimes:
        """The histogram of the steps' forward wall times."""
        return self.core.step_times

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV block hash (running requests keep their KV); later requests
        compute their prompts afresh. Returns how many blocks were forgotten."""
        count = self.scheduler.reset_prefix_cache()
        if self.kv_events is not None:  # AllBlocksCleared goes out now, not with a next step
            self.kv_events.flush()
        return count
