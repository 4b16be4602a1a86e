"""Live sessions: append prompt fragments, resume, resample, rewind, inspect and close.

A session is an ordinary request opened with `session=True`. When one of its generation
segments ends it is not freed: it keeps its blocks, computes the token it sampled last (so
its KV covers every token) and parks PAUSED with the logits of its last position stored.
Every operation below only appends tokens, drops tokens from the tail, or flips whether
reaching the end samples; the scheduler's single rule does the rest, so an append of k tokens
computes exactly those k tokens (plus a pending sampled token) and re-allocates nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loom.core.request import RequestStatus
from loom.engine.sequence import SequenceState
from loom.errors import (
    InvalidRequestError,
    InvalidSessionStateError,
)
from loom.sample import make_generator, sample_from_logits
from loom.sampling_params import SamplingParams
from loom.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from loom.engine.llm_engine import LLMEngine

# Tokens re-tokenised together with a fragment by `prefill(..., heal=True)`.
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


class SessionOps:
    """The session half of `LLMEngine` (mixed into it; uses its scheduler and tokenizer)."""

    def _session(self: LLMEngine, request_id: str) -> SequenceState:
        seq_ids = self._lookup_group(request_id)
        seq = self._seqs[seq_ids[0]]
        if not seq.is_session:
            raise InvalidSessionStateError(
                f"request {request_id!r} is not a session; add it with session=True"
            )
        return seq

    def prefill(
        self: LLMEngine,
        request_id: str,
        fragment: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        heal: bool = False,
    ) -> int:
        """Append a fragment (text or token ids) after every token so far; returns its length.

        Generating sessions continue after the fragment with their parameters. Paused ones
        compute the fragment and stay paused with new last logits, unless `sampling_params`
        is given, which starts a new generation segment after it. Text is tokenised on its
        own (no BOS); `heal=True` re-tokenises the last few tokens together with the text and
        rewinds only the tokens that change.
        """
        seq = self._session(request_id)
        request = seq.request
        if isinstance(fragment, str):
            if not fragment:
                raise InvalidRequestError(f"session {request_id!r}: the fragment is empty")
            if heal:
                keep, new_ids = self._heal(seq, fragment)
            else:
                keep = request.num_tokens
                new_ids = self.tokenizer.encode(fragment, add_special_tokens=False)
        else:
            if heal:
                raise InvalidRequestError("heal=True needs a text fragment")
            keep, new_ids = request.num_tokens, [int(t) for t in fragment]
        if not new_ids:
            raise InvalidRequestError(f"session {request_id!r}: the fragment has no tokens")
        vocab = self.runner.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in new_ids):
            raise InvalidRequestError(
                f"session {request_id!r}: token ids must be in [0, {vocab})"
            )
        self._check_length(request_id, keep + len(new_ids))
        if keep < request.num_tokens:
            self._require_paused(seq, "heal")
            self._truncate_session(seq, keep)
        request.append_tokens(new_ids)
        seq.append_fragment(new_ids)
        seq.last_logits = None
        if sampling_params is not None:
            seq.start_segment(sampling_params, self.config.device)
        request.sample_when_computed = seq.generating
        self.scheduler.wake(request)
        return len(new_ids)

    def resume(self: LLMEngine, request_id: str, sampling_params: SamplingParams) -> None:
        """Start a generation segment on a paused session; its first token comes from the
        stored logits without a model call, or, while its last tokens are still uncomputed (a
        fragment just appended), from the step that computes them."""
        seq = self._session(request_id)
        self._require_paused(seq, "resume")
        self._check_length(request_id, seq.request.num_tokens + 1)
        seq.start_segment(sampling_params, self.config.device)
        seq.request.sample_when_computed = True
        if seq.last_logits is not None:
            failed = self._sample_and_append([seq], seq.last_logits.unsqueeze(0))
            if failed:  # the segment ended at once; the session is as it was
                raise InvalidRequestError(failed[seq.group_id])
        self.scheduler.wake(seq.request)

    def stop_generation(self: LLMEngine, request_id: str) -> bool:
        """End a generating session's segment now, as a stop condition would (its caller went
        away): the session stays, computes its pending token and pauses with its last
        logits. Returns False when it was not generating."""
        seq = self._session(request_id)
        if not seq.generating or seq.request.is_finished:
            return False
        seq.finish_reason = "abort"
        self._end_segment(seq, RequestStatus.FINISHED_ABORTED)
        self._groups_to_report.add(seq.group_id)
        return True

    def resample(
        self: LLMEngine,
        request_id: str,
        sampling_params: SamplingParams | None = None,
        n: int = 1,
    ) -> list[Sample]:
        """Draw `n` tokens from the stored logits; the session does not change."""
        seq = self._session(request_id)
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
            eos_token_ids=self.eos_token_ids,
        )
        return [Sample(t, self.tokenizer.decode([t]), lp) for t, lp in draws]

    def get_logits(self: LLMEngine, request_id: str) -> torch.Tensor:
        """The stored float32 logits row for the session's last position."""
        return self._stored_logits(self._session(request_id)).clone()

    def rewind(self: LLMEngine, request_id: str, num_tokens: int) -> None:
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
        self._truncate_session(seq, total - num_tokens)
        request = seq.request
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        request.sample_when_computed = False
        self.scheduler.wake(request)

    def get_session(self: LLMEngine, request_id: str) -> SessionView:
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
        )

    def close(self: LLMEngine, request_id: str) -> None:
        """End the session and free everything it holds."""
        self._session(request_id)
        self._end_group(request_id, "closed", RequestStatus.FINISHED_STOPPED)

    # ---- helpers ---------------------------------------------------------------------

    def _require_paused(self: LLMEngine, seq: SequenceState, op: str) -> None:
        if seq.generating:
            raise InvalidSessionStateError(
                f"cannot {op} session {seq.group_id!r}: it is generating; wait for the "
                "segment to end or abort it"
            )

    def _stored_logits(self: LLMEngine, seq: SequenceState) -> torch.Tensor:
        if seq.last_logits is None:
            raise InvalidSessionStateError(
                f"session {seq.group_id!r} has no stored logits yet: step the engine until "
                "its last prefill is computed"
            )
        return seq.last_logits

    def _truncate_session(self: LLMEngine, seq: SequenceState, num_tokens: int) -> None:
        """Cut the session to its first `num_tokens` tokens and rebuild its output text."""
        request = seq.request
        self.scheduler.truncate(request, num_tokens)
        request.num_prompt_tokens = min(request.num_prompt_tokens, num_tokens)
        seq.output_token_ids = request.token_ids[request.num_prompt_tokens :]
        seq.segment_token_ids = []
        seq.segment_text = ""
        seq.text_cut = None
        seq.last_logits = None
        seq.detokenizer = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, skip_special_tokens=seq.params.skip_special_tokens
        )
        seq.detokenizer.append_prompt(seq.output_token_ids)

    def _heal(self: LLMEngine, seq: SequenceState, fragment: str) -> tuple[int, list[int]]:
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
        common = 0
        while common < min(len(tail), len(new)) and tail[common] == new[common]:
            common += 1
        return start + common, new[common:]
