"""`EngineCore`: the scheduler, the executor and the sequence table, stepped together.

    step():  schedule            Scheduler.schedule()            -> SchedulerOutput
             execute             executor.execute_model(...)     -> ModelOutput (logits)
             update              Scheduler.update_after_step     (frontiers, loads)
                                 Pooler.take                     (embedding requests)
                                 TokenAppender.sample_and_append (tokens, hooks, stops)
             outputs             OutputProcessor.group_output    -> list[RequestOutput]

Faults stay with the requests they concern: a logits processor or a hook that raises fails
its request (a session's segment ends, the session stays); requests that can never get
their blocks, or whose external KV failed to load under policy "fail", fail; an exception
in the forward itself fails every request of that step with a `LoomError` message. In each
case the other requests keep their state and the engine serves the next step.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from loom.core.request import RequestStatus
from loom.core.scheduler import Scheduler
from loom.core.scheduler_output import ScheduledChunk, SchedulerOutput
from loom.core.step_cost import attention_units
from loom.engine.hooks import HookContext, SequenceHook
from loom.engine.output_processor import OutputProcessor
from loom.engine.outputs import RequestOutput
from loom.engine.pooling import EmbeddingOutput, EmbeddingRequestOutput, EngineOutput, Pooler
from loom.engine.sequence import SequenceState
from loom.engine.sequence_table import SequenceTable
from loom.engine.speculation import Speculator
from loom.engine.stats import StepTimes
from loom.engine.structured_output import StructuredOutputs
from loom.engine.token_appender import TokenAppender
from loom.runner import ModelOutput
from loom.runner.executor import Executor
from loom.sample.sampler import position_logprobs
from loom.spec_decode import SpeculativeConfig
from loom.tokenizer import Tokenizer

logger = logging.getLogger("loom")


class EngineCore:
    """One step at a time over every live request; knows nothing of prompts or sessions'
    public operations (the `LLMEngine` facade and `SessionManager` do)."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        tokenizer: Tokenizer,
        *,
        device: str,
        max_model_len: int,
        num_kv_blocks: int,
        eos_token_ids: set[int],
        hooks: list[SequenceHook],
        speculative: SpeculativeConfig | None = None,
        structured: StructuredOutputs | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.num_kv_blocks = num_kv_blocks
        self.table = SequenceTable(scheduler, tokenizer, device, max_model_len, structured)
        self.hook_context = HookContext(self.table)
        self.speculator = Speculator(speculative) if speculative else None
        self.appender = TokenAppender(
            self.table, eos_token_ids, hooks, self.hook_context, self.speculator
        )
        self.appender.early_masks = device != "cpu"
        self.table.on_sequence_finished.append(self.appender.run_hooks_finished)
        self.outputs = OutputProcessor(self.table)
        self.pooler = Pooler()  # embedding requests' pooled rows so far
        self.table.on_group_ended.append(lambda group, *_: self.pooler.drop(group))
        self.last_scheduler_output: SchedulerOutput | None = None
        self.num_steps = 0
        self.last_step_ms = 0.0  # wall time of the last step's forward
        self.step_times = StepTimes()
        # The async engine sets this False and runs hooks' async calls on its own loop.
        self.run_async_calls_inline = True

    # ---- the step ------------------------------------------------------------------------

    def has_work(self) -> bool:
        """True while a step would do something (paused sessions do not count)."""
        return self.scheduler.has_work() or bool(self.table.changed_groups)

    def step(self) -> list[EngineOutput]:
        """schedule -> execute -> update -> outputs."""
        outputs: list[EngineOutput] = list(self._report_changed())
        self._propose_drafts()
        sched_out = self.scheduler.schedule()
        self.last_scheduler_output = sched_out
        if sched_out.is_empty:
            return outputs + self._fail_unschedulable(sched_out)
        self.appender.start_masks(sched_out.chunks)  # grammars work while the model runs
        started = time.perf_counter()
        try:
            result = self.executor.execute_model(sched_out)
        except Exception as error:  # concerns the whole step: fail its requests, go on
            self.appender.drop_early_masks()
            logger.exception("a step failed")
            return outputs + self._fail_step(sched_out, error)
        self._observe_step(sched_out, (time.perf_counter() - started) * 1e3)
        self.scheduler.update_after_step(sched_out, result.load_errors, result.load_failure)
        self.num_steps += 1
        outputs += self._update(sched_out, result)
        self.appender.drop_early_masks()  # none left unless nothing sampled
        outputs += self._fail_unschedulable(sched_out)
        if self.run_async_calls_inline:
            outputs += self._run_pending_calls_inline()
        return outputs

    def _observe_step(self, sched_out: SchedulerOutput, ms: float) -> None:
        """Feed a step's measured time to the scheduler's cost model (the time budget) and
        to the step-time record."""
        self.last_step_ms = ms
        self.step_times.observe(ms)
        cost = self.scheduler.cost
        if cost is None or sched_out.load_failures or sched_out.loading_request_ids:
            return  # a step that also loaded external K/V is no measure of compute
        tokens = sum(len(c.token_ids) for c in sched_out.chunks)
        attention = sum(attention_units(len(c.token_ids), c.start_pos) for c in sched_out.chunks)
        cost.observe(tokens, attention, ms)

    def _report_changed(self) -> list[RequestOutput]:
        """Outputs of groups changed between steps (a segment stopped by its caller)."""
        groups = [g for g in self.table.changed_groups if self.table.is_live(g)]
        self.table.changed_groups.clear()
        return self._outputs_of(groups)

    def _outputs_of(self, groups: list[str], errors: dict[str, str] | None = None
                    ) -> list[RequestOutput]:
        outputs = []
        for group in groups:
            error = (errors or {}).get(group)
            out = self.outputs.group_output(group, error)
            if out is None:  # nothing to send (a finished request always sends)
                continue
            outputs.append(out)
            if out.finished:
                self.table.end_group(group, "failed" if error else "finished",
                                     RequestStatus.FINISHED_STOPPED)
        return outputs

    def _propose_drafts(self) -> None:
        """Speculative decoding: give decoding sequences draft tokens for this step."""
        running = self.scheduler.running
        if self.speculator is None or not self.speculator.enabled_for(len(running)):
            return
        for request in running:
            self.speculator.propose(self.table[request.request_id], self.table.max_model_len)

    def _update(self, sched_out: SchedulerOutput, result: ModelOutput) -> list[EngineOutput]:
        """Store logits, sample the sequences that generate, apply stop checks, build the
        outputs of every request the step touched."""
        outputs: list[EngineOutput] = []
        if result.pooled is not None:
            outputs += self._pool(sched_out, result.pooled)
        logits = result.logits
        touched: dict[str, None] = {}
        to_sample: list[SequenceState] = []
        drafts: list[list[int]] = []
        picked: list[int] = []
        row = 0
        for chunk in sched_out.chunks:
            if not chunk.num_logits:
                continue
            seq = self.table[chunk.request_id]
            if chunk.all_logits:  # a prompt chunk's rows: prompt logprobs
                self._add_prompt_logprobs(seq, chunk, logits[row : row + chunk.num_logits])
            at = row + chunk.num_logits - chunk.num_sample_logits  # the sampling rows
            row += chunk.num_logits
            if not chunk.needs_logits:
                continue
            if seq.generating:
                if seq.keep_prefill_logits and not chunk.num_draft_tokens:
                    seq.last_logits = logits[at].clone()  # the end of an appended fragment
                    seq.keep_prefill_logits = False
                to_sample.append(seq)
                drafts.append(chunk.token_ids[len(chunk.token_ids) - chunk.num_draft_tokens :])
                picked.extend(range(at, at + chunk.num_sample_logits))
            else:
                self.table.pause(seq, logits[at])
            touched[seq.group_id] = None
        failed: dict[str, str] = {}
        if to_sample:
            if picked != list(range(logits.shape[0])):  # else every row, in order: no copy
                logits = logits.index_select(0, torch.tensor(picked, device=logits.device))
            failed = self.appender.sample_and_append(to_sample, logits, drafts)
        # A session whose processor or hook raised is paused with its segment ended: the
        # error goes on its output; any other request fails.
        ended = {g: e for g, e in failed.items() if not self.table.is_session_group(g)}
        outputs += self._outputs_of([g for g in touched if g not in ended], failed)
        return outputs + self.fail_groups(ended)

    def _pool(self, sched_out: SchedulerOutput, pooled: torch.Tensor
              ) -> list[EmbeddingRequestOutput]:
        """Fold the pooling chunks' rows (one each, in chunk order) into their requests; a
        request whose prompt is now computed gets its embedding and ends (its blocks go
        back)."""
        outputs = []
        rows = iter(pooled.cpu())
        for chunk in sched_out.chunks:
            if chunk.pooling is None:
                continue
            row = next(rows)
            seq = self.table.get(chunk.request_id)
            if seq is None or chunk.request_id not in self.pooler:
                continue  # ended while the step ran
            embedding = self.pooler.take(chunk, row, seq.request.num_tokens)
            if embedding is None:
                continue
            outputs.append(EmbeddingRequestOutput(
                request_id=seq.group_id, outputs=EmbeddingOutput(embedding),
                prompt_token_ids=list(seq.prompt_ids), prompt=seq.prompt))
            self.table.end_group(seq.group_id, "finished", RequestStatus.FINISHED_STOPPED)
        return outputs

    @staticmethod
    def _add_prompt_logprobs(seq: SequenceState, chunk: ScheduledChunk,
                             rows: torch.Tensor) -> None:
        """Prompt logprobs from a prompt chunk's rows: the row of position p gives the
        prompt token at p + 1 (up to the last prompt token)."""
        entries = seq.prompt_logprobs
        if entries is None:
            return
        prompt, start = seq.prompt_ids, chunk.start_pos
        at = len(entries) - 1  # the position whose row gives the next missing entry
        stop = min(chunk.end_pos, len(prompt) - 1)
        if start <= at < stop:  # (rows recomputed after a preemption add nothing)
            entries += position_logprobs(rows[at - start : stop - start],
                                         prompt[at + 1 : stop + 1],
                                         seq.params.prompt_logprobs or 0)

    def _fail_unschedulable(self, sched_out: SchedulerOutput) -> list[RequestOutput]:
        """Fail the requests (their trees) that can never get the KV blocks they need, so
        nothing waits or preempts itself forever, and those whose external K/V failed to load
        under kv_load_failure_policy="fail"; every other request keeps its state.

        The scheduler names those that pinned sessions crowd out. When a step runs nothing and
        names none, the head of the queue waits on blocks that only it could free (held by
        pinned or blocked sequences waiting behind it): it fails too."""
        total = self.num_kv_blocks
        errors: dict[str, str] = {}
        for item in sched_out.unschedulable:
            seq = self.table.get(item.request_id)
            if seq is not None and seq.group_id not in errors:
                errors[seq.group_id] = (
                    f"request {seq.group_id!r} cannot be scheduled: it needs "
                    f"{item.blocks_needed} KV blocks but only {item.blocks_available} of "
                    f"{total} can ever be free for it; the rest are held by pinned sessions"
                )
        for failure in sched_out.load_failures:
            seq = self.table.get(failure.request_id)
            if seq is not None and seq.group_id not in errors:
                errors[seq.group_id] = failure.message
        stuck = sched_out.is_empty and not errors and not self.scheduler.running
        if stuck and self.scheduler.waiting:
            group = self.table[self.scheduler.waiting[0].request_id].group_id
            errors[group] = (
                f"request {group!r} cannot be scheduled: it needs more KV blocks than are "
                f"free ({self.scheduler.kv.num_free_blocks} of {total}); the rest are held "
                "by pinned sessions or blocked sequences"
            )
        return self.fail_groups(errors)

    def _fail_step(self, sched_out: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """The forward raised: every request in the step fails (its blocks go back); the
        scheduler forgets the step, so nothing waits on it."""
        message = f"the step running this request failed: {type(error).__name__}: {error}"
        in_step = [c.request_id for c in sched_out.chunks] + sched_out.loading_request_ids
        seqs = (self.table.get(request_id) for request_id in in_step)
        return self.fail_groups({seq.group_id: message for seq in seqs if seq is not None})

    def fail_groups(self, errors: dict[str, str]) -> list[RequestOutput]:
        """End every sequence of each group with finish_reason "error" (its blocks go back
        to the pool) and report the group's error; other requests keep their state."""
        outputs = []
        for group, error in errors.items():
            if not self.table.is_live(group):
                continue  # already ended in this step
            for seq in self.table.group(group):
                if not seq.request.is_finished:
                    self.table.fail(seq)
            outputs += self._outputs_of([group], {group: error})
        return outputs

    def _run_pending_calls_inline(self) -> list[RequestOutput]:
        """The synchronous engine runs hooks' async calls itself, concurrently, to completion.
        A call that raises fails only its request (returns those requests' outputs)."""
        calls = self.hook_context.take_pending_calls()
        if not calls:
            return []

        async def run_all() -> list[object]:
            return await asyncio.gather(*(call.fn() for call in calls), return_exceptions=True)

        failed: dict[str, str] = {}
        for call, result in zip(calls, asyncio.run(run_all()), strict=True):
            seq = self.table.get(call.seq_id)
            if isinstance(result, BaseException):
                if seq is not None:
                    failed.setdefault(seq.group_id, f"an async call of request "
                                      f"{seq.group_id!r} raised {type(result).__name__}: {result}")
                continue
            self.hook_context.unblock(call.seq_id, result)  # type: ignore[arg-type]
        return self.fail_groups(failed)
