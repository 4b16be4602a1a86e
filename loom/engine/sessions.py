"""Live sessions: append prompt fragments, resume, resample, rewind, fork, inspect and close.

A session is an ordinary request opened with `session=True`. When one of its generation
segments ends it is not freed: it keeps its blocks, computes the token it sampled last (so
its KV covers every token) and parks PAUSED with the logits of its last position stored.
Every operation below only appends tokens, drops tokens from the tail, or flips whether
reaching the end samples; the scheduler's single rule does the rest, so an append of k tokens
computes exactly those k tokens (plus a pending sampled token) and re-allocates nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loom.core.request import RequestStatus
from loom.engine.input_processor import InputProcessor
from loom.engine.sequence import SequenceState
from loom.engine.sequence_table import SequenceTable
from loom.engine.session_snapshot import SessionSnapshot
from loom.engine.token_appender import TokenAppender
from loom.engine.token_budget import TokenBudget
from loom.errors import (
    InvalidRequestError,
    InvalidSessionStateError,
)
from loom.sample import make_generator, sample_from_logits
from loom.sampling_params import SamplingParams

# Tokens re-tokenised together with a fragment by `append(..., heal=True)`.
HEAL_WINDOW_TOKENS = 6


@dataclass(frozen=True)
class Sample:
    """One token drawn by `resample`: its id, its text and its logprob under the raw logits."""

    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class SessionView:
    """A read-only snapshot of a session."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    num_prompt_tokens: int
    num_computed_tokens: int
    status: str
    block_ids: tuple[int, ...]
    generating: bool
    pinned: bool
    has_logits: bool = False  # the last position's logits are stored (resample can draw)
    # Tokens whose K/V came from the prefix cache, a KV store or a forked session, not
    # computed here.
    num_cached_tokens: int = 0


class SessionManager:
    """The session operations, through the sequence table (which owns the sessions)."""

    def __init__(
        self,
        table: SequenceTable,
        inputs: InputProcessor,
        appender: TokenAppender,
        session_ttl_s: float | None,
    ) -> None:
        self.table = table
        self.scheduler = table.scheduler
        self.tokenizer = table.tokenizer
        self.inputs = inputs
        self.appender = appender
        self.session_ttl_s = session_ttl_s

    def _session(self, request_id: str) -> SequenceState:
        return self.table.session(request_id)

    def _fragment_target(self, request_id: str, sampling_params: SamplingParams | None,
                         heal: bool) -> SequenceState:
        """The sequence a fragment goes to: a session's, or that of any live request of one
        sequence (the fragment is input computed by the next steps; the request then goes on
        generating with its parameters, and ends as it would have)."""
        group = self.table.group(request_id)
        seq = group[0]
        if seq.is_session:
            return seq
        if len(group) > 1:
            raise InvalidRequestError(
                f"request {request_id!r} has {len(group)} sequences; a fragment goes to a "
                "request of one sequence or to a session")
        if sampling_params is not None or heal:
            raise InvalidSessionStateError(
                f"request {request_id!r} is not a session: a fragment continues its generation "
                "(new sampling parameters and heal=True need session=True)")
        return seq

    def append(
        self,
        request_id: str,
        fragment: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        heal: bool = False,
        budget: TokenBudget | None = None,
    ) -> int:
        """Append a fragment (text or token ids) after every token so far; returns its length.

        Any live request of one sequence takes a fragment: a plain request, like a generating
        session, continues after it with its parameters. Paused ones
        compute the fragment and stay paused with new last logits, unless `sampling_params`
        is given, which starts a new generation segment after it. Text is tokenised on its
        own (no BOS); `heal=True` re-tokenises the last few tokens together with the text and
        rewinds only the tokens that change. With `budget`, the segment's max_tokens is the
        budget resolved for the session's length after the fragment. Every check, the
        budget's included, comes before anything changes.
        """
        seq = self._fragment_target(request_id, sampling_params, heal)
        request = seq.request
        if heal:
            if not isinstance(fragment, str):
                raise InvalidRequestError("heal=True needs a text fragment")
            if not fragment:
                raise InvalidRequestError(f"session {request_id!r}: the fragment is empty")
            keep, new_ids = self._heal(seq, fragment)
            if not new_ids:
                raise InvalidRequestError(f"session {request_id!r}: the fragment has no tokens")
            self.inputs.check_token_ids(request_id, new_ids)
        else:
            keep, new_ids = request.num_tokens, self.inputs.encode_fragment(request_id, fragment)
        self.inputs.check_length(request_id, keep + len(new_ids))
        if sampling_params is not None:
            sampling_params = self._budgeted(sampling_params, budget, keep + len(new_ids))
            self.inputs.check_params(request_id, sampling_params)
        if keep < request.num_tokens:
            self._require_paused(seq, "heal")
            self.table.truncate(seq, keep)
        self.table.append(seq, new_ids, produced=False)
        if not seq.is_session:  # the row after the fragment is kept for `resample`
            seq.keep_prefill_logits = True
        if sampling_params is not None:
            self.table.start_segment(seq, sampling_params)
        return len(new_ids)

    def resume(self, request_id: str, sampling_params: SamplingParams,
               budget: TokenBudget | None = None) -> SamplingParams:
        """Start a generation segment on a paused session; its first token comes from the
        stored logits without a model call, or, while its last tokens are still uncomputed (a
        fragment just appended), from the step that computes them. With `budget`, its
        max_tokens is the budget resolved for the session's length. Returns the parameters
        it runs with."""
        seq = self._session(request_id)
        self._require_paused(seq, "resume")
        self.inputs.check_length(request_id, seq.request.num_tokens + 1)
        sampling_params = self._budgeted(sampling_params, budget, seq.request.num_tokens)
        self.inputs.check_params(request_id, sampling_params)
        self.table.start_segment(seq, sampling_params)
        if seq.last_logits is not None:
            failed = self.appender.sample_and_append([seq], seq.last_logits.unsqueeze(0))
            if failed:  # the segment ended at once; the session is as it was
                raise InvalidRequestError(failed[seq.group_id])
        self.table.wake(seq)
        return sampling_params

    def _budgeted(self, params: SamplingParams, budget: TokenBudget | None,
                  num_tokens: int) -> SamplingParams:
        """`params` with max_tokens from `budget` for a session of `num_tokens` tokens (its
        first token is sampled after all of them)."""
        if budget is None:
            return params
        limit = budget.resolve(num_tokens + 1, self.inputs.max_model_len)
        return params.with_updates(max_tokens=limit)

    def stop_generation(self, request_id: str) -> bool:
        """End a generating session's segment now, as a stop condition would (its caller went
        away): the session stays, computes its pending token and pauses with its last
        logits. Returns False when it was not generating."""
        seq = self._session(request_id)
        if not seq.generating or seq.request.is_finished:
            return False
        self.table.end_segment(seq, RequestStatus.FINISHED_ABORTED)
        self.table.changed_groups.add(seq.group_id)
        return True

    def resample(
        self,
        request_id: str,
        sampling_params: SamplingParams | None = None,
        n: int = 1,
    ) -> list[Sample]:
        """Draw `n` tokens from the stored logits (a session's last position, or the end of a
        plain request's last fragment); the request does not change."""
        seq = self._with_logits(request_id)
        logits = self._stored_logits(seq)
        params = sampling_params or seq.params
        generator = None if params.seed is None else make_generator(params.seed, logits.device)
        # As the first token of a new segment would be drawn (see `resume`): penalties see the
        # prompt, min_tokens suppresses EOS, and no segment tokens exist yet.
        draws = sample_from_logits(
            logits,
            params,
            n=n,
            generator=generator,
            prompt_token_ids=seq.prompt_token_ids,
            eos_token_ids=self.appender.eos_token_ids,
        )
        return [Sample(t, self.tokenizer.decode([t]), lp) for t, lp in draws]

    def get_logits(self, request_id: str) -> torch.Tensor:
        """The stored float32 logits row (see `resample`)."""
        return self._stored_logits(self._with_logits(request_id)).clone()

    def has_logits(self, request_id: str) -> bool:
        """Whether `resample` can draw now: stored logits, and (a session) not generating."""
        seq = self._with_logits(request_id)
        return seq.last_logits is not None and not (seq.is_session and seq.generating)

    def logits_pending(self, request_id: str) -> bool:
        """Whether steps will yet store logits `resample` can draw from: a session that
        generates or has tokens to compute; a plain request whose appended fragment is not
        computed yet."""
        seq = self._with_logits(request_id)
        if seq.is_session:
            return seq.generating or self.scheduler.has_work()
        return seq.keep_prefill_logits

    def _with_logits(self, request_id: str) -> SequenceState:
        """A session's sequence, or that of a plain request of one sequence (whose logits
        are stored at the end of a fragment appended to it)."""
        group = self.table.group(request_id)
        if group[0].is_session:
            return group[0]
        if len(group) > 1:
            raise InvalidRequestError(
                f"request {request_id!r} has {len(group)} sequences; stored logits belong to "
                "a session or a request of one sequence")
        return group[0]

    def rewind(self, request_id: str, num_tokens: int) -> None:
        """Drop the last `num_tokens` tokens and the blocks that no longer hold any token.

        The new last token is computed once more to restore its logits (one recomputed token).
        """
        seq = self._session(request_id)
        self._require_paused(seq, "rewind")
        total = seq.request.num_tokens
        if not 0 < num_tokens < total:
            raise InvalidRequestError(
                f"session {request_id!r}: can rewind 1..{total - 1} tokens, not {num_tokens}"
            )
        self.table.rewind(seq, total - num_tokens)

    def fork(self, request_id: str, new_id: str, num_tokens: int | None = None, *,
             pin: bool = False, ttl_s: float | None = None) -> int:
        """Open session `new_id` as a copy of the paused session `request_id` cut to its
        first `num_tokens` tokens (default: all), sharing its blocks copy-on-write: neither
        changes the other afterwards. The copy recomputes at least its last token (to store
        its logits; more only where the parent had not computed them) and then pauses.
        Returns the number of tokens whose K/V it shares. A pool without a block to spare
        for the copy of a partial block is an `InvalidRequestError` (nothing changed)."""
        seq = self._session(request_id)
        self._require_paused(seq, "fork")
        total = seq.request.num_tokens
        keep = total if num_tokens is None else num_tokens
        if not 1 <= keep <= total:
            raise InvalidRequestError(
                f"session {request_id!r}: a fork keeps 1..{total} tokens, not {keep}")
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidRequestError(f"session {new_id!r}: ttl_s must be > 0, got {ttl_s}")
        shared = min(seq.request.num_computed_tokens, keep - 1)
        if not self.table.fork_session(seq, new_id, keep, shared, pin=pin, ttl_s=ttl_s):
            raise InvalidRequestError(
                f"session {request_id!r}: no free KV block for the fork {new_id!r}")
        return shared

    def get_session(self, request_id: str) -> SessionView:
        """A read-only view of the session's tokens, text, frontier, status and blocks."""
        seq = self._session(request_id)
        request = seq.request
        return SessionView(
            request_id=request_id,
            token_ids=tuple(request.token_ids),
            text=self.tokenizer.decode(request.token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            num_computed_tokens=request.num_computed_tokens,
            status=request.status.name,
            block_ids=tuple(self.scheduler.kv.block_ids(request.request_id)),
            generating=seq.generating,
            pinned=request.pinned,
            has_logits=seq.last_logits is not None,
            num_cached_tokens=request.num_cached_tokens,
        )

    def snapshot(self, request_id: str, kv_fingerprint: str | None = None) -> SessionSnapshot:
        """The paused session's state (see `loom.engine.session_snapshot`); an
        `InvalidSessionStateError` while it generates."""
        seq = self._session(request_id)
        self._require_paused(seq, "save")
        request = seq.request
        return SessionSnapshot(
            session_id=request_id,
            token_ids=tuple(request.token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            params=seq.params.with_updates(logits_processors=None),
            pinned=request.pinned,
            ttl_s=seq.ttl_s,
            logits=None if seq.last_logits is None else seq.last_logits.to("cpu"),
            grammar_positions=None if seq.grammar is None else tuple(seq.grammar.positions),
            kv_fingerprint=kv_fingerprint,
        )

    def restore(self, snapshot: SessionSnapshot, session_id: str | None = None) -> None:
        """Open a saved session again (under `session_id`, default its own id): PAUSED at
        once with its stored logits; its full blocks are taken from the prefix cache or the
        KV store where they are held, the rest computed, when an operation next wakes it.
        Refused (nothing opened) when the id is in use or the tokens do not fit this engine
        (vocabulary, context length)."""
        sid = snapshot.session_id if session_id is None else session_id
        self.table.check_new_id(sid)
        self.inputs.check_token_ids(sid, snapshot.token_ids)
        self.inputs.check_length(sid, len(snapshot.token_ids))
        self.inputs.check_params(sid, snapshot.params)
        logits = snapshot.logits
        if logits is not None and logits.shape != (self.inputs.vocab_size,):
            logits = None  # another vocabulary's row: the step recomputes the last position
        logits = None if logits is None else logits.to(self.table.device)
        self.table.restore_session(
            sid, snapshot.token_ids, snapshot.num_prompt_tokens, snapshot.params,
            pinned=snapshot.pinned, ttl_s=snapshot.ttl_s, logits=logits,
            grammar_positions=snapshot.grammar_positions)
        if logits is not None:
            # Paused, as it was saved: like a paused session preempted, it holds no K/V until
            # its next operation wakes it (its blocks then come from the prefix cache or the
            # store, the rest is computed), and the stored logits serve resample and resume
            # now. Without logits its next steps compute them, then it pauses.
            self.table.pause(self.table.session(sid), logits)

    def close(self, request_id: str) -> None:
        """End the session and free everything it holds."""
        self._session(request_id)
        self.table.end_group(request_id, "closed", RequestStatus.FINISHED_STOPPED)

    def expire_idle(self) -> None:
        """Close the paused sessions idle for longer than their time to live."""
        idle = self.scheduler.idle
        if not idle:
            return
        now = time.monotonic()
        expired = []
        for request in idle.values():
            seq = self.table[request.request_id]
            ttl = seq.ttl_s if seq.ttl_s is not None else self.session_ttl_s
            if ttl is not None and now - request.last_used > ttl:
                expired.append(seq.group_id)
        for group in expired:
            self.table.end_group(group, "expired", RequestStatus.FINISHED_ABORTED)

    # ---- helpers ---------------------------------------------------------------------

    def require_paused(self, request_id: str, op: str) -> None:
        """An `InvalidSessionStateError` naming `op` unless the session is paused."""
        self._require_paused(self._session(request_id), op)

    def _require_paused(self, seq: SequenceState, op: str) -> None:
        if seq.generating:
            raise InvalidSessionStateError(
                f"cannot {op} session {seq.group_id!r}: it is generating; wait for the "
                "segment to end or abort it"
            )

    def _stored_logits(self, seq: SequenceState) -> torch.Tensor:
        if seq.last_logits is None:
            if not seq.is_session:
                raise InvalidSessionStateError(
                    f"request {seq.group_id!r} has no stored logits: a request that is not a "
                    "session stores them at the end of a fragment appended to it (prefill), "
                    "once that is computed")
            raise InvalidSessionStateError(
                f"session {seq.group_id!r} has no stored logits yet: step the engine until "
                "its last prefill is computed"
            )
        return seq.last_logits

    def _heal(self, seq: SequenceState, fragment: str) -> tuple[int, list[int]]:
        """(tokens to keep, tokens to append) so that the tail re-tokenises with the fragment."""
        ids = seq.request.token_ids
        special = set(self.tokenizer.all_special_ids)
        start = len(ids)
        while start > 1 and len(ids) - start < HEAL_WINDOW_TOKENS and ids[start - 1] not in special:
            start -= 1
        tail = ids[start:]
        tail_text = self.tokenizer.decode(tail, skip_special_tokens=False)
        if self.tokenizer.encode(tail_text, add_special_tokens=False) != tail:
            start, tail, tail_text = len(ids), [], ""  # the tail does not round-trip: no healing
        new = self.tokenizer.encode(tail_text + fragment, add_special_tokens=False)
        common = common_prefix(tail, new)
        return start + common, new[common:]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
