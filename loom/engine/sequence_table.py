"""`SequenceTable`: every live sequence and request group, and one lifecycle API for them.

The table is the one place that says whether an id is live: a request id names a group (its
n sequences, or a session, plus the children a request tree forked), each sequence id names
a `SequenceState` whose `request` the scheduler holds. Every change to a sequence that the
scheduler must see goes through here, so the two never disagree:

    add_group / fork / fork_session / restore_session
      -> start_segment / append / truncate / rewind / wake / block / drop_drafts / pause
      -> end_segment (a terminal RequestStatus, whose finish_reason the outputs carry) / fail
      -> end_group (why the id ended: finished, failed, aborted, closed, expired)

The engine core drives the scheduler (schedule, update after the step); every other change
to a sequence's `Request` is one of the methods above.

Invariants: a sequence is in the table iff its group is; its `Request` is in the scheduler
until it finishes (then only the table remembers it, until the group ends); an ended group's
id is remembered with why it ended (`ended_reason`), so late callers get a clear error.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from loom.core.request import Request, RequestStatus
from loom.core.scheduler import Scheduler
from loom.engine.sequence import SequenceState
from loom.engine.structured_output import GrammarMatcher, StructuredOutputs
from loom.errors import (
    DuplicateRequestError,
    InvalidSessionStateError,
    SessionClosedError,
    UnknownRequestError,
)
from loom.sample import make_generator
from loom.sampling_params import SamplingParams
from loom.tokenizer import IncrementalDetokenizer, Tokenizer

_MAX_REMEMBERED_ENDED = 10_000
# Spreads children's seed streams apart from their parent's.
_CHILD_SEED_STRIDE = 1_000_003


class SequenceTable:
    """Owns the engine's sequences and groups; sessions and request trees act through it."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        device: str,
        max_model_len: int,
        structured: StructuredOutputs | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.structured = structured
        self.tokenizer = tokenizer
        self.device = device
        self.max_model_len = max_model_len
        self._seqs: dict[str, SequenceState] = {}
        self._groups: dict[str, list[str]] = {}
        # Ids that ended recently and why ("finished", "failed", "aborted", "closed",
        # "expired").
        self._ended: OrderedDict[str, str] = OrderedDict()
        # Called with a sequence id when a (non-session) sequence finishes: hooks join on it.
        self.on_sequence_finished: list[Callable[[str], None]] = []
        # Groups changed outside a step (a segment stopped by a caller, a join that reached
        # the context limit): their outputs go out with the next step's.
        self.changed_groups: set[str] = set()
        # Called with a session's sequence when it parks with its last logits stored, with a
        # session's id when one is restored, and with (request id, why, was a session) when
        # a group ends: the engines keep session snapshots and output queues through these.
        self.on_session_paused: list[Callable[[SequenceState], None]] = []
        # Called with a session's sequence when its tokens change outside a segment (a
        # fragment appended, a rewind, a heal) or a segment ends: what a snapshot holds.
        self.on_session_changed: list[Callable[[SequenceState], None]] = []
        self.on_session_restored: list[Callable[[str], None]] = []
        self.on_group_ended: list[Callable[[str, str, bool], None]] = []
        # Asked for an id this process never saw: True when it restored a session by that id
        # (from a snapshot a KV store kept across a restart), which the lookup then returns.
        self.restore_missing: Callable[[str], bool] | None = None
        # The engine's clock (seconds): stamps each segment's start (`segment_started`);
        # whoever measures from those stamps reads this clock.
        self.clock: Callable[[], float] = time.perf_counter

    # ---- lookups ------------------------------------------------------------------------

    def get(self, seq_id: str) -> SequenceState | None:
        """The sequence, or None when it is not live."""
        return self._seqs.get(seq_id)

    def __getitem__(self, seq_id: str) -> SequenceState:
        return self._seqs[seq_id]

    def is_live(self, request_id: str) -> bool:
        """Whether a request (or session) by this id is live."""
        return request_id in self._groups

    def ended_reason(self, request_id: str) -> str | None:
        """Why a recently ended request ended, or None (live, or never seen)."""
        return self._ended.get(request_id)

    @property
    def ended(self) -> OrderedDict[str, str]:
        """Recently ended ids -> why, oldest first (read-only)."""
        return self._ended

    def group_ids(self) -> list[str]:
        """Ids of the live requests and sessions."""
        return list(self._groups)

    def group(self, request_id: str) -> list[SequenceState]:
        """Every sequence of a live request (its n, then tree children in fork order); a
        clear error for an ended or unknown id."""
        seq_ids = self._groups.get(request_id)
        if seq_ids is None and request_id not in self._ended and self.restore_missing \
                and self.restore_missing(request_id):
            seq_ids = self._groups.get(request_id)
        if seq_ids is None:
            reason = self._ended.get(request_id)
            if reason in ("closed", "expired"):
                raise SessionClosedError(f"session {request_id!r} is {reason}")
            if reason is not None:
                raise UnknownRequestError(f"request {request_id!r} has already {reason}")
            raise UnknownRequestError(f"unknown request id {request_id!r}")
        return [self._seqs[s] for s in seq_ids]

    def roots(self, request_id: str) -> list[SequenceState]:
        """The request's own sequences (not tree children)."""
        return [s for s in self.group(request_id) if s.parent_id is None]

    def session(self, request_id: str) -> SequenceState:
        """The session's sequence; an error when the id is not a live session."""
        seq = self.group(request_id)[0]
        if not seq.is_session:
            raise InvalidSessionStateError(
                f"request {request_id!r} is not a session; add it with session=True"
            )
        return seq

    def is_session_group(self, request_id: str) -> bool:
        """True when the live group is a session."""
        return any(self._seqs[s].is_session for s in self._groups.get(request_id, ()))

    def __iter__(self) -> Iterator[SequenceState]:
        return iter(self._seqs.values())

    # ---- lifecycle ----------------------------------------------------------------------

    def check_new_id(self, request_id: str) -> None:
        """A `DuplicateRequestError` when a live request already has this id."""
        if request_id in self._groups:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use")

    def add_group(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        session: bool = False,
        pin: bool = False,
        ttl_s: float | None = None,
        pooling: str | None = None,
    ) -> None:
        """Create a request's sequences (n of them, or one session), each generating with
        `params`, and queue them (`start_segment(seq, None)` turns sampling off). With
        `pooling` ("last", "mean") it is one embedding request that samples nothing."""
        self.check_new_id(request_id)
        seq_ids = [request_id] if params.n == 1 else [f"{request_id}/{i}" for i in range(params.n)]
        shared_prompt = list(prompt_ids)
        for index, seq_id in enumerate(seq_ids):
            request = Request(seq_id, list(prompt_ids), pinned=pin, priority=params.priority,
                              wants_prompt_logits=params.prompt_logprobs is not None,
                              pooling=pooling, sample_when_computed=pooling is None)
            seq = self._sequence(request, params, group_id=request_id, index=index,
                                 prompt=prompt, is_session=session, ttl_s=ttl_s,
                                 prompt_ids=shared_prompt)
            if params.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]
            self.start_segment(seq, None if pooling else params)
            self._seqs[seq_id] = seq
            self.scheduler.add_request(request)
        self._groups[request_id] = seq_ids
        self._ended.pop(request_id, None)

    def _sequence(self, request: Request, params: SamplingParams,
                  **fields: Any) -> SequenceState:
        """A sequence over `request`'s tokens so far, generating with `params`, its text
        detokenised from there on; `fields` are the other SequenceState fields."""
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.token_ids, skip_special_tokens=params.skip_special_tokens)
        return SequenceState(request=request, params=params, detokenizer=detokenizer, **fields)

    def start_segment(self, seq: SequenceState, params: SamplingParams | None) -> None:
        """Begin a generation segment with `params`, or (None) stop sampling: reaching the
        end of the tokens then parks the sequence with its logits stored."""
        if params is None:
            seq.generating = False
            return
        seq.request.priority = params.priority
        seq.start_segment(params, self.device, self.clock())
        seq.grammar = self._grammar_for(seq, params)

    def _grammar_for(self, seq: SequenceState, params: SamplingParams) -> GrammarMatcher | None:
        """The segment's matcher: none when unconstrained; the sequence's own when it follows
        the same constraint, its document is not complete and the sequence still ends where
        the document stands (a segment cut by max_tokens, or after a rewind, goes on with it;
        after an appended fragment a new document starts); else a fresh one."""
        constraint = params.structured_outputs
        if constraint is None or self.structured is None:
            return None
        current = seq.grammar
        if current is not None and current.key == constraint.key and not current.is_finished \
                and current.error is None and current.continues(len(seq.request.token_ids)):
            return current
        return self.structured.matcher(seq.group_id or seq.request_id, constraint)

    def end_segment(self, seq: SequenceState, status: RequestStatus,
                    stop_reason: int | str | None = None) -> None:
        """The segment stopped with a terminal `status` (its finish_reason follows from it;
        `stop_reason`: the stop token or string): a plain sequence finishes and frees its
        blocks; a session keeps its KV and computes its pending token, then parks."""
        seq.end_segment(status, stop_reason)
        if not seq.is_session:
            self.scheduler.finish(seq.request_id, status)
            for listener in self.on_sequence_finished:
                listener(seq.request_id)
            return
        seq.generating = False
        seq.last_logits = None
        self._changed(seq)

    def _changed(self, seq: SequenceState) -> None:
        if seq.is_session:
            for listener in self.on_session_changed:
                listener(seq)

    def fail(self, seq: SequenceState) -> None:
        """End a sequence (a session's too) with FINISHED_ERROR and free its blocks: its
        request failed (a step or a load that cannot go on)."""
        seq.end_segment(RequestStatus.FINISHED_ERROR)
        self.scheduler.finish(seq.request_id, RequestStatus.FINISHED_ERROR)

    def wake(self, seq: SequenceState) -> None:
        """The sequence has work again (a segment started, tokens to compute)."""
        self.scheduler.wake(seq.request)

    def block(self, seq: SequenceState) -> None:
        """Park a sequence that waits on its children or an event, keeping its blocks."""
        self.scheduler.park(seq.request, RequestStatus.BLOCKED)

    def drop_drafts(self, seq: SequenceState, num_drafts: int = 0) -> None:
        """Forget the last `num_drafts` (rejected) draft tokens and give back the blocks
        that held only drafts."""
        if num_drafts:
            seq.request.truncate(seq.request.num_tokens - num_drafts)
        self.scheduler.truncate(seq.request, seq.request.num_tokens)

    def rewind(self, seq: SequenceState, num_tokens: int) -> None:
        """Cut a paused session to its first `num_tokens` tokens and recompute the new last
        one (its logits are stored again)."""
        self.truncate(seq, num_tokens)
        request = seq.request
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        self.scheduler.wake(request)

    def pause(self, seq: SequenceState, logits_row: torch.Tensor) -> None:
        """A sequence computed its last token without sampling: it parks with its blocks,
        and a session keeps `logits_row` (the last position's) for `resample` / `resume`."""
        if seq.is_session:
            seq.last_logits = logits_row.clone()
        self.scheduler.park(seq.request, RequestStatus.PAUSED)
        if seq.is_session:
            for listener in self.on_session_paused:
                listener(seq)

    def append(self, seq: SequenceState, token_ids: list[int], *, produced: bool) -> None:
        """Append tokens after every token so far; the next steps compute exactly them.

        `produced`: a hook's result (part of the request's output) rather than a caller's
        input. A sampling sequence samples again once they are computed."""
        seq.request.append_tokens(token_ids)
        if produced:
            seq.append_produced(token_ids)
        else:
            seq.append_input(token_ids)
        seq.last_logits = None
        self.scheduler.wake(seq.request)
        if not produced:
            self._changed(seq)

    def truncate(self, seq: SequenceState, num_tokens: int) -> None:
        """Cut a paused session to its first `num_tokens` tokens (blocks that no longer hold
        a token go back to the pool) and rebuild its output text."""
        request = seq.request
        self.scheduler.truncate(request, num_tokens)
        request.num_prompt_tokens = min(request.num_prompt_tokens, num_tokens)
        seq.prompt_ids = request.token_ids[: request.num_prompt_tokens]
        seq.output_token_ids = request.token_ids[request.num_prompt_tokens :]
        seq.segment_token_ids = []
        seq.segment_text = ""
        seq.text_cut_chars = 0
        seq.last_logits = None
        seq.clear_delta()
        self._changed(seq)
        if seq.grammar is not None:
            seq.grammar.cut(num_tokens)
        seq.detokenizer = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_ids, skip_special_tokens=seq.params.skip_special_tokens
        )
        seq.detokenizer.append_prompt(seq.output_token_ids)

    def fork(self, parent_id: str, max_tokens: int | None) -> str | None:
        """A child of `parent_id` sharing its computed KV (ref-counted blocks), generating
        with the parent's parameters (`max_tokens` overrides its budget); None when the pool
        has no block to spare."""
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
        child = self._sequence(request, params, group_id=parent.group_id, parent_id=parent_id,
                               depth=parent.depth + 1)
        child.start_segment(params, self.device, self.clock())
        # The child continues its parent's document from the fork.
        child.grammar = parent.grammar.copy() if parent.grammar is not None else None
        if params.seed is not None:
            seed = params.seed + _CHILD_SEED_STRIDE * (index + 1) + parent.depth
            child.generator = make_generator(seed, self.device)
        parent.children.append(child_id)
        parent.all_children.append(child_id)
        self._seqs[child_id] = child
        self._groups[parent.group_id].append(child_id)
        self.scheduler.add_request(request)
        return child_id

    def fork_session(self, parent: SequenceState, new_id: str, num_tokens: int,
                     num_shared: int, *, pin: bool = False, ttl_s: float | None = None) -> bool:
        """A new session `new_id` (its own group) holding the first `num_tokens` tokens of the
        paused session `parent`, sharing the K/V of its first `num_shared` (<= the parent's
        computed tokens, < num_tokens) copy-on-write; the rest is computed by the next steps,
        after which it pauses with its last logits stored. False (nothing changed) when the
        pool has no block for the copy of a partial block."""
        self.check_new_id(new_id)
        if not self.scheduler.kv.fork(parent.request_id, new_id, num_shared):
            return False
        tokens = list(parent.request.token_ids[:num_tokens])
        request = Request(new_id, tokens, num_computed_tokens=num_shared,
                          max_computed_tokens=num_shared, pinned=pin,
                          priority=parent.request.priority, num_cached_tokens=num_shared)
        params = parent.params
        seq = self._sequence(request, params, group_id=new_id, is_session=True, ttl_s=ttl_s,
                             prompt_ids=tokens)
        seq.start_segment(params, self.device, self.clock())
        self.start_segment(seq, None)  # paused once its tokens are computed
        if parent.grammar is not None:  # the document as far as the copy goes
            seq.grammar = parent.grammar.copy()
            seq.grammar.cut(num_tokens)
        self._seqs[new_id] = seq
        self._groups[new_id] = [new_id]
        self._ended.pop(new_id, None)
        self.scheduler.add_request(request)
        return True

    def restore_session(self, session_id: str, token_ids: Sequence[int],
                        num_prompt_tokens: int, params: SamplingParams, *, pinned: bool,
                        ttl_s: float | None, logits: torch.Tensor | None,
                        grammar_positions: Sequence[int] | None) -> None:
        """Open session `session_id` over `token_ids` (the first `num_prompt_tokens` its
        prompt, the rest its output so far) as a saved one was: paused once the next steps
        have its K/V (taken from the prefix cache or the KV store where they hold it, else
        computed), `logits` stored meanwhile, its structured-output matcher fed the tokens
        at `grammar_positions` again."""
        self.check_new_id(session_id)
        tokens = list(token_ids)
        request = Request(session_id, tokens[:num_prompt_tokens], pinned=pinned,
                          priority=params.priority)
        seq = self._sequence(request, params, group_id=session_id, is_session=True,
                             ttl_s=ttl_s)
        # The rest as it came: after the prompt, in the output and its text.
        request.append_tokens(tokens[num_prompt_tokens:])
        seq.append_input(tokens[num_prompt_tokens:])
        seq.start_segment(params, self.device, self.clock())
        self.start_segment(seq, None)  # paused once its tokens are computed
        constraint = params.structured_outputs
        if grammar_positions is not None and constraint is not None \
                and self.structured is not None:
            seq.grammar = self.structured.matcher(session_id, constraint)
            for position in grammar_positions:
                seq.grammar.consume(tokens[position], position)
        seq.last_logits = logits
        self._seqs[session_id] = seq
        self._groups[session_id] = [session_id]
        self._ended.pop(session_id, None)
        self.scheduler.add_request(request)
        for listener in self.on_session_restored:
            listener(session_id)

    def unblock(self, seq_id: str, token_ids: list[int] | None) -> None:
        """Append a blocked sequence's result (they are all it prefills) and let it go on.

        Never past the context limit: a longer result is cut, and the sequence stops."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.request.is_finished:
            return
        if token_ids:
            room = self.max_model_len - seq.request.num_tokens
            self.append(seq, token_ids[:room], produced=True)
        seq.blocked = False
        self.scheduler.wake(seq.request)
        if seq.request.num_tokens >= self.max_model_len and seq.generating:
            self.end_segment(seq, RequestStatus.FINISHED_LENGTH)
            self.changed_groups.add(seq.group_id)

    def end_group(self, request_id: str, reason: str, status: RequestStatus) -> None:
        """Forget a request and every sequence of it; the scheduler frees their blocks."""
        was_session = self.is_session_group(request_id)
        for seq_id in self._groups.pop(request_id, []):
            self._seqs.pop(seq_id, None)
            if seq_id in self.scheduler.requests:
                self.scheduler.finish(seq_id, status)
        self.changed_groups.discard(request_id)
        self._ended[request_id] = reason
        while len(self._ended) > _MAX_REMEMBERED_ENDED:
            self._ended.popitem(last=False)
        for listener in self.on_group_ended:
            listener(request_id, reason, was_session)
