"""`LLMEngine`: add requests, `step()` = schedule -> execute -> update, and live sessions."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from loom.core.request import Request, RequestStatus
from loom.core.scheduler import Scheduler
from loom.core.scheduler_output import SchedulerOutput
from loom.engine.config import EngineArgs, EngineConfig
from loom.engine.hooks import HookContext, PendingCall, SequenceHook
from loom.engine.outputs import RequestOutput
from loom.engine.promise_sync import PromiseSyncHook
from loom.engine.resolve import build_engine_parts
from loom.engine.sequence import SequenceState
from loom.engine.session_ops import SessionOps
from loom.engine.speculation import Speculator
from loom.engine.stats import EngineStats
from loom.engine.token_ops import TokenOps
from loom.engine.tree_ops import TreeOps
from loom.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    PromptTooLongError,
    SessionClosedError,
    UnknownRequestError,
)
from loom.kv_connector import KVConnectorRole, create_connector
from loom.runner.model_runner import ModelRunner
from loom.sample import Sampler
from loom.sampling_params import SamplingParams
from loom.tokenizer import IncrementalDetokenizer, Tokenizer

_MAX_REMEMBERED_ENDED = 10_000


class LLMEngine(SessionOps, TreeOps, TokenOps):
    """The synchronous engine: a scheduler, a model runner, a sampler and output processing.

    Request ids name what a caller added; with `n > 1` each of the n sequences is scheduled
    as its own `Request` ("id/0", "id/1", ...) and their outputs are gathered under the id.
    """

    def __init__(self, config: EngineConfig, runner: ModelRunner, tokenizer: Tokenizer) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.kv_connector = None
        if config.kv_transfer is not None:
            self.kv_connector = create_connector(
                config.kv_transfer, config.kv_cache_spec, KVConnectorRole.SCHEDULER
            )
        self.scheduler = Scheduler(config.scheduler, self.kv_connector)
        self.sampler = Sampler()
        self.speculator = Speculator(config.speculative) if config.speculative else None
        self.eos_token_ids: set[int] = set(tokenizer.eos_token_ids) | set(
            runner.model_config.eos_token_ids
        )
        self._seqs: dict[str, SequenceState] = {}
        self._groups: dict[str, list[str]] = {}
        # Ids that ended recently and why ("finished", "aborted", "closed", "expired").
        self._ended: OrderedDict[str, str] = OrderedDict()
        self.last_scheduler_output: SchedulerOutput | None = None
        self.num_steps = 0
        self.hooks: list[SequenceHook] = list(config.hooks)
        if config.special_kwargs is not None:
            self.hooks.insert(
                0, PromiseSyncHook.from_kwargs(config.special_kwargs, tokenizer.token_to_id)
            )
        self.hook_context = HookContext(self)
        self._pending_calls: list[PendingCall] = []
        # Groups changed outside a step (an async call's result ended them): reported next step.
        self._groups_to_report: set[str] = set()
        # The async engine sets this False and runs hooks' async calls on its own loop.
        self.run_async_calls_inline = True

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """Load the model and tokenizer and size the KV pool as the arguments say."""
        config, runner, tokenizer = build_engine_parts(args)
        return cls(config, runner, tokenizer)

    # ---- adding and removing ------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        session: bool = False,
        pin: bool = False,
        ttl_s: float | None = None,
    ) -> None:
        """Queue a request (or open a session with `session=True`).

        A session opened without `sampling_params` only computes its prompt and pauses with
        the last logits stored; `resume` or `prefill(..., sampling_params)` starts generating.
        `ttl_s` overrides the engine's `session_ttl_s` for this session.
        """
        prefill_only = session and sampling_params is None
        params = sampling_params or SamplingParams()
        if request_id in self._groups:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use")
        if session and params.n != 1:
            raise InvalidRequestError(f"session {request_id!r}: n must be 1, got {params.n}")
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidRequestError(f"session {request_id!r}: ttl_s must be > 0, got {ttl_s}")
        prompt_text, prompt_ids = self._encode_prompt(request_id, prompt)
        seq_ids = [request_id] if params.n == 1 else [f"{request_id}/{i}" for i in range(params.n)]
        for index, seq_id in enumerate(seq_ids):
            request = Request(seq_id, list(prompt_ids), pinned=pin)
            seq = SequenceState(
                request=request,
                params=params,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens
                ),
                group_id=request_id,
                index=index,
                prompt=prompt_text,
                is_session=session,
                ttl_s=ttl_s,
            )
            seq.start_segment(params, self.config.device)
            if prefill_only:
                seq.generating = request.sample_when_computed = False
            self._seqs[seq_id] = seq
            self.scheduler.add_request(request)
        self._groups[request_id] = seq_ids
        self._ended.pop(request_id, None)

    def _encode_prompt(
        self, request_id: str, prompt: str | Sequence[int]
    ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            text: str | None = prompt
        else:
            ids, text = [int(t) for t in prompt], None
        if not ids:
            raise InvalidRequestError(f"request {request_id!r}: the prompt is empty")
        self._check_length(request_id, len(ids))
        vocab = self.runner.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise InvalidRequestError(f"request {request_id!r}: token ids must be in [0, {vocab})")
        return text, ids

    def _check_length(self, request_id: str, num_tokens: int) -> None:
        limit = self.config.max_model_len
        if num_tokens > limit:
            raise PromptTooLongError(
                f"request {request_id!r}: {num_tokens} tokens exceed the context limit "
                f"max_model_len={limit}"
            )

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        """Stop requests (or sessions) now and free their blocks; unknown ids raise."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self._lookup_group(rid)
        for rid in ids:
            self._end_group(rid, "aborted", RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs (paused sessions do not count)."""
        return self.scheduler.has_work() or bool(self._groups_to_report)

    def get_num_unfinished_requests(self) -> int:
        """Requests (by caller id) not finished yet, sessions included."""
        return len(self._groups)

    def _lookup_group(self, request_id: str) -> list[str]:
        seq_ids = self._groups.get(request_id)
        if seq_ids is None:
            reason = self._ended.get(request_id)
            if reason in ("closed", "expired"):
                raise SessionClosedError(f"session {request_id!r} is {reason}")
            if reason is not None:
                raise UnknownRequestError(f"request {request_id!r} has already {reason}")
            raise UnknownRequestError(f"unknown request id {request_id!r}")
        return seq_ids

    def _end_group(self, request_id: str, reason: str, status: RequestStatus) -> None:
        for seq_id in self._groups.pop(request_id, []):
            self._seqs.pop(seq_id, None)
            if seq_id in self.scheduler.requests:
                self.scheduler.finish(seq_id, status)
        self._ended[request_id] = reason
        while len(self._ended) > _MAX_REMEMBERED_ENDED:
            self._ended.popitem(last=False)

    # ---- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step and return the outputs of the requests it advanced."""
        self._expire_idle_sessions()
        reported = [self._group_output(g) for g in self._groups_to_report if g in self._groups]
        self._groups_to_report.clear()
        self._propose_drafts()
        sched_out = self.scheduler.schedule()
        self.last_scheduler_output = sched_out
        if sched_out.is_empty:
            return reported + self._fail_reported(sched_out)
        if sched_out.block_copies:
            self.runner.copy_blocks(sched_out.block_copies)
        load_failure = self.runner.load_kv(sched_out.kv_connector_metadata)
        logits = self.runner.execute(sched_out.chunks)
        load_errors = self.runner.save_kv()
        self.scheduler.update_after_step(sched_out, load_errors, load_failure)
        self.num_steps += 1
        outputs = reported + self._process_logits(sched_out, logits)
        outputs += self._fail_reported(sched_out)
        if self._pending_calls and self.run_async_calls_inline:
            self._run_pending_calls_inline()
        return outputs

    def _propose_drafts(self) -> None:
        """Speculative decoding: give decoding sequences draft tokens for this step."""
        running = self.scheduler.running
        if self.speculator is None or not self.speculator.enabled_for(len(running)):
            return
        for request in running:
            self.speculator.propose(self._seqs[request.request_id], self.config.max_model_len)

    def _process_logits(
        self, sched_out: SchedulerOutput, logits: torch.Tensor
    ) -> list[RequestOutput]:
        """Store logits, sample the requests that generate, apply stop checks, build outputs."""
        touched: dict[str, None] = {}
        to_sample: list[SequenceState] = []
        drafts: list[list[int]] = []
        picked: list[int] = []
        row = 0
        for chunk in sched_out.chunks:
            if not chunk.needs_logits:
                continue
            seq = self._seqs[chunk.request_id]
            if seq.request.sample_when_computed:
                to_sample.append(seq)
                drafts.append(chunk.token_ids[len(chunk.token_ids) - chunk.num_draft_tokens :])
                picked.extend(range(row, row + chunk.num_logits))
            else:
                if seq.is_session:
                    seq.last_logits = logits[row].clone()
                self.scheduler.park(seq.request, RequestStatus.PAUSED)
            touched[seq.group_id] = None
            row += chunk.num_logits
        failed: dict[str, str] = {}
        if to_sample:
            if picked != list(range(logits.shape[0])):  # else every row, in order: no copy
                logits = logits.index_select(0, torch.tensor(picked, device=logits.device))
            failed = self._sample_and_append(to_sample, logits, drafts)
        # A session whose processor raised is paused (see _sample_and_append): report the
        # error on its output; any other request fails.
        ended = {g: e for g, e in failed.items() if not self._groups_are_sessions(g)}
        outputs = [self._group_output(rid, failed.get(rid)) for rid in touched if rid not in ended]
        return outputs + self._fail_groups(ended)

    def _groups_are_sessions(self, group: str) -> bool:
        return any(self._seqs[s].is_session for s in self._groups.get(group, ()))

    def _fail_reported(self, sched_out: SchedulerOutput) -> list[RequestOutput]:
        """Fail the requests (their trees) that can never get the KV blocks they need, so
        nothing waits or preempts itself forever, and those whose external K/V failed to load
        under kv_load_failure_policy="fail"; every other request keeps its state.

        The scheduler names those that pinned sessions crowd out. When a step runs nothing and
        names none, the head of the queue waits on blocks that only it could free (held by
        pinned or blocked sequences waiting behind it): it fails too."""
        total = self.config.num_kv_blocks
        errors: dict[str, str] = {}
        for item in sched_out.unschedulable:
            seq = self._seqs.get(item.request_id)
            if seq is not None and seq.group_id not in errors:
                errors[seq.group_id] = (
                    f"request {seq.group_id!r} cannot be scheduled: it needs "
                    f"{item.blocks_needed} KV blocks but only {item.blocks_available} of "
                    f"{total} can ever be free for it; the rest are held by pinned sessions"
                )
        for failure in sched_out.load_failures:
            seq = self._seqs.get(failure.request_id)
            if seq is not None and seq.group_id not in errors:
                errors[seq.group_id] = failure.message
        stuck = sched_out.is_empty and not errors and not self.scheduler.running
        if stuck and self.scheduler.waiting:
            group = self._seqs[self.scheduler.waiting[0].request_id].group_id
            errors[group] = (
                f"request {group!r} cannot be scheduled: it needs more KV blocks than are "
                f"free ({self.num_free_blocks} of {total}); the rest are held by pinned "
                "sessions or blocked sequences"
            )
        return self._fail_groups(errors)

    def _fail_groups(self, errors: dict[str, str]) -> list[RequestOutput]:
        """End every sequence of each group with finish_reason "error" (its blocks go back
        to the pool) and report the group's error; other requests keep their state."""
        outputs = []
        for group, error in errors.items():
            if group not in self._groups:
                continue  # already ended in this step
            for seq_id in self._groups[group]:
                seq = self._seqs[seq_id]
                if not seq.request.is_finished:
                    seq.finish_reason = "error"
                    self.scheduler.finish(seq_id, RequestStatus.FINISHED_ERROR)
            outputs.append(self._group_output(group, error))
        return outputs

    def _end_segment(self, seq: SequenceState, status: RequestStatus) -> None:
        """A plain sequence finishes; a session keeps its KV and computes its pending token."""
        if not seq.is_session:
            self.scheduler.finish(seq.request_id, status)
            for hook in self.hooks:
                hook.on_finished(self.hook_context, seq.request_id)
            return
        seq.generating = False
        seq.request.sample_when_computed = False
        seq.last_logits = None

    def _group_output(self, request_id: str, error: str | None = None) -> RequestOutput:
        """The request's output now (its n sequences and its tree); ends it when all finished."""
        seqs = [self._seqs[s] for s in self._groups[request_id]]
        finished = all(s.request.is_finished for s in seqs)
        roots = [s for s in seqs if s.parent_id is None]
        out = RequestOutput(
            request_id=request_id,
            prompt=roots[0].prompt,
            prompt_token_ids=roots[0].prompt_token_ids,
            outputs=[s.completion() for s in roots],
            finished=finished,
            children=[c for s in roots for c in self._child_outputs(s)],
            error=error,
        )
        if finished:
            reason = "failed" if error else "finished"
            self._end_group(request_id, reason, RequestStatus.FINISHED_STOPPED)
        return out

    def _expire_idle_sessions(self) -> None:
        if not self.scheduler.idle:
            return
        now = time.monotonic()
        default = self.config.session_ttl_s
        expired = []
        for request in self.scheduler.idle.values():
            seq = self._seqs[request.request_id]
            ttl = seq.ttl_s if seq.ttl_s is not None else default
            if ttl is not None and now - request.last_used > ttl:
                expired.append(request.request_id)
        for rid in expired:
            self._end_group(self._seqs[rid].group_id, "expired", RequestStatus.FINISHED_ABORTED)

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
        kv, spec, external = self.scheduler.kv, self.speculator, self.scheduler.external
        return EngineStats(
            num_steps=self.num_steps,
            num_preemptions=self.scheduler.num_preemptions,
            num_recomputed_tokens=self.scheduler.num_recomputed_tokens,
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
            kv_saved_blocks=getattr(self.runner.kv_connector, "num_saved_blocks", 0),
        )

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV block hash (running requests keep their KV); later requests
        compute their prompts afresh. Returns how many blocks were forgotten."""
        return self.scheduler.reset_prefix_cache()
