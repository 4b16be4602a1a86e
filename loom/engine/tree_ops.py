"""Request trees: children that share their parent's KV, blocking, joining, async hook calls.

Mixed into `LLMEngine`. Every sequence of a tree belongs to its root request's group, so an
abort or the end of the request frees the whole tree; a child's blocks are its parent's
(reference-counted) plus its own.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from loom.core.request import Request, RequestStatus
from loom.engine.hooks import AsyncResult, PendingCall
from loom.engine.outputs import RequestOutput
from loom.engine.sequence import SequenceState
from loom.sample import make_generator
from loom.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from loom.engine.llm_engine import LLMEngine

# Spreads children's seed streams apart from their parent's.
_CHILD_SEED_STRIDE = 1_000_003


class TreeOps:
    """The request-tree half of `LLMEngine`."""

    def _spawn_child(self: LLMEngine, parent_id: str, max_tokens: int | None) -> str | None:
        """Fork `parent_id` into a new child sequence; None if the pool has no block to spare."""
        parent = self._seqs[parent_id]
        index = len(parent.all_children)
        child_id = f"{parent_id}.{index}"
        tokens = list(parent.request.token_ids)
        computed = parent.request.num_computed_tokens
        if not self.scheduler.kv.fork(parent_id, child_id, computed):
            return None
        request = Request(
            child_id, tokens, num_computed_tokens=computed, max_computed_tokens=computed
        )
        params = parent.params
        if max_tokens is not None:
            params = params.with_updates(
                max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens), n=1
            )
        child = SequenceState(
            request=request,
            params=params,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, tokens, skip_special_tokens=params.skip_special_tokens
            ),
            group_id=parent.group_id,
            parent_id=parent_id,
            depth=parent.depth + 1,
        )
        child.start_segment(params, self.config.device)
        if params.seed is not None:
            seed = params.seed + _CHILD_SEED_STRIDE * (index + 1) + parent.depth
            child.generator = make_generator(seed, self.config.device)
        parent.children.append(child_id)
        parent.all_children.append(child_id)
        self._seqs[child_id] = child
        self._groups[parent.group_id].append(child_id)
        self.scheduler.add_request(request)
        return child_id

    def _unblock(self: LLMEngine, seq_id: str, append: AsyncResult | None) -> None:
        """Append tokens to a blocked sequence (they are all it prefills) and let it go on."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.request.is_finished:
            return
        if append:
            ids = (
                self.tokenizer.encode(append, add_special_tokens=False)
                if isinstance(append, str)
                else [int(t) for t in append]
            )
            # Never past the context limit: a longer merge is cut, and the sequence stops.
            room = self.config.max_model_len - seq.request.num_tokens
            seq.request.append_tokens(ids[:room])
            seq.append_fragment(ids[:room])
        seq.blocked = False
        seq.request.sample_when_computed = seq.generating
        self.scheduler.wake(seq.request)
        if seq.request.num_tokens >= self.config.max_model_len and seq.generating:
            seq.finish_reason = "length"
            self._end_segment(seq, RequestStatus.FINISHED_LENGTH)
            self._groups_to_report.add(seq.group_id)

    def take_pending_calls(self: LLMEngine) -> list[PendingCall]:
        """Async calls hooks asked for since the last take (the async engine runs them)."""
        calls, self._pending_calls = self._pending_calls, []
        return calls

    def finish_pending_call(self: LLMEngine, call: PendingCall, result: AsyncResult) -> None:
        """Append an async call's result to its sequence and let it continue."""
        self._unblock(call.seq_id, result)

    def _run_pending_calls_inline(self: LLMEngine) -> None:
        """The synchronous engine runs hooks' async calls itself, concurrently, to completion."""
        calls = self.take_pending_calls()
        if not calls:
            return

        async def run_all() -> list[AsyncResult]:
            return await asyncio.gather(*(call.fn() for call in calls))

        for call, result in zip(calls, asyncio.run(run_all()), strict=True):
            self.finish_pending_call(call, result)

    def _child_outputs(self: LLMEngine, seq: SequenceState) -> list[RequestOutput]:
        """The output tree under a sequence."""
        outputs = []
        for child_id in seq.all_children:
            child = self._seqs[child_id]
            outputs.append(
                RequestOutput(
                    request_id=child_id,
                    prompt=None,
                    prompt_token_ids=child.prompt_token_ids,
                    outputs=[child.completion()],
                    finished=child.request.is_finished,
                    children=self._child_outputs(child),
                )
            )
        return outputs
