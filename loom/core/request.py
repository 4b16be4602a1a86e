"""`Request`: a token list plus a computed frontier, and its lifecycle states."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from loom.core.block_hash import extend_block_hashes

_arrival_counter = itertools.count()


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every status above PREEMPTED is a finished one.

    WAITING -> RUNNING -> FINISHED_*
                 |  ^
                 v  |
        PAUSED (session holds KV, nothing to do) / BLOCKED (waits on children or an
        event, holds KV) / PREEMPTED (KV dropped, recomputed when scheduled again)
    """

    WAITING = 0
    RUNNING = 1
    PAUSED = 2
    BLOCKED = 3
    PREEMPTED = 4
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8

    @property
    def is_finished(self) -> bool:
        """True for the terminal statuses."""
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """vLLM's finish_reason string for a terminal status, else None: the one mapping
        from how a sequence ended to what its outputs say (`SequenceState.end_segment`)."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """The scheduler's view of one sequence.

        token_ids:  [ prompt ........ | generated / appended ........ ]
                    [ K/V in cache ...............| uncomputed ........]
                                                  ^ num_computed_tokens

    Invariant: 0 <= num_computed_tokens <= len(token_ids). The scheduler only ever moves the
    frontier forward by computing tokens; `truncate` (rewind) and preemption move it back.
    `sample_when_computed` says whether reaching the end of `token_ids` produces a sampled token
    (generation) or only stores the last logits (a prefill into a paused session).

    Speculative decoding appends draft tokens tentatively: the last `num_draft_tokens` of
    `token_ids` are guesses, all uncomputed, scheduled with the token before them so one step
    yields logits for each; the engine keeps the accepted ones and truncates the rest. Drafts
    exist only inside an engine step (proposed before `schedule`, settled after the forward).
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int = -1
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    sample_when_computed: bool = True
    pinned: bool = False
    # Admission order among waiting work (vLLM's `priority`): lower first, then arrival.
    priority: int = 0
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))
    last_used: float = 0.0
    # Highest frontier ever reached: tokens recomputed below it are counted as recompute.
    max_computed_tokens: int = 0
    # Tentative tokens at the end of token_ids (speculative decoding); 0 outside a step.
    num_draft_tokens: int = 0
    # Prefix caching: keys of the first full blocks of token_ids (`loom.core.block_hash`),
    # filled lazily by the KV cache manager; `truncate` drops those of blocks losing a token.
    block_hashes: list[bytes] = field(default_factory=list)
    hash_block_size: int = 0
    # Tokens up to which prefix-cache queries were counted (hit-rate statistics).
    num_cache_queried_tokens: int = 0
    # Tokens whose K/V this request took from the prefix cache, a KV store or the session it
    # was forked from instead of computing them.
    num_cached_tokens: int = 0
    # The logits of every prompt position are wanted (prompt logprobs): the prompt's chunks
    # yield a row per token, and none of it comes from the prefix cache or a KV store.
    wants_prompt_logits: bool = False
    # A pooling (embedding) request: "last" or "mean" (None: it generates). It samples
    # nothing: its chunks carry the kind, the runner pools their hidden states, and the
    # engine finishes it once its prompt is computed.
    pooling: str | None = None
    # K/V already in the request's blocks above the frontier (loaded from an external store):
    # sorted, disjoint [start, end) ranges. The uncomputed tokens between them are the gaps;
    # the frontier jumps over a ready range when it reaches its start.
    ready_ranges: list[tuple[int, int]] = field(default_factory=list)
    # An external load into the request's blocks is in flight: it is not scheduled until the
    # load's outcome is known (which ranges really arrived).
    loading_kv: bool = False
    # End of the range an external store matched (0: none); tokens computed below it are gaps.
    external_end: int = 0

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        """All tokens known so far (prompt, generated, appended)."""
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V is not in the cache yet."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position's forward output is needed (prompt logprobs, mean
        pooling): none of the prompt comes from the prefix cache or a KV store."""
        return self.wants_prompt_logits or self.pooling == "mean"

    @property
    def is_finished(self) -> bool:
        """True once the request reached a terminal status."""
        return self.status.is_finished

    def append_tokens(self, token_ids: list[int]) -> None:
        """Append tokens after all known ones; they become uncomputed."""
        self.token_ids.extend(token_ids)

    def add_draft_tokens(self, token_ids: list[int]) -> None:
        """Append tentative tokens after every known one (see the class docstring)."""
        self.token_ids.extend(token_ids)
        self.num_draft_tokens += len(token_ids)

    def discard_draft_tokens(self, count: int | None = None) -> None:
        """Drop the last `count` draft tokens (all of them by default); they were never computed."""
        count = self.num_draft_tokens if count is None else min(count, self.num_draft_tokens)
        if count > 0:
            self.truncate(len(self.token_ids) - count)

    def block_keys(self, block_size: int, num_blocks: int) -> list[bytes]:
        """Chained hashes of the first `num_blocks` full blocks of `token_ids` (computed once
        and kept in `block_hashes`; `truncate` drops those of blocks losing a token)."""
        self.hash_block_size = block_size
        return extend_block_hashes(self.block_hashes, self.token_ids, block_size, num_blocks)

    @property
    def computable_end(self) -> int:
        """One past the last token the next chunk may compute: the start of the next ready
        range (a gap ends there), else the end of the tokens.

            tokens: [ computed | gap ........ | ready (loaded) | gap | ready | rest ... ]
                               ^ frontier     ^ computable_end
        """
        return self.ready_ranges[0][0] if self.ready_ranges else len(self.token_ids)

    def advance_frontier(self, num_tokens: int) -> None:
        """Count the first `num_tokens` tokens as computed (a chunk wrote them, cached blocks
        hold them), then skip every ready range the frontier reaches."""
        if not self.num_computed_tokens <= num_tokens <= len(self.token_ids):
            raise ValueError(
                f"request {self.request_id}: frontier {self.num_computed_tokens} cannot move to "
                f"{num_tokens} of {len(self.token_ids)} tokens"
            )
        while self.ready_ranges and self.ready_ranges[0][0] <= num_tokens:
            num_tokens = max(num_tokens, self.ready_ranges.pop(0)[1])
        self.num_computed_tokens = num_tokens
        self.max_computed_tokens = max(self.max_computed_tokens, num_tokens)
        if num_tokens >= self.external_end:
            self.external_end = 0

    def drop_external_kv(self) -> None:
        """Forget loaded ranges above the frontier (their blocks were freed or failed)."""
        self.ready_ranges.clear()
        self.loading_kv = False
        self.external_end = 0

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens; the frontier follows if it was beyond.

        Drafts are the tail, so they go first."""
        self.num_draft_tokens = max(0, self.num_draft_tokens - (len(self.token_ids) - num_tokens))
        del self.token_ids[num_tokens:]
        self.num_computed_tokens = min(self.num_computed_tokens, num_tokens)
        self.max_computed_tokens = min(self.max_computed_tokens, num_tokens)
        self.num_cache_queried_tokens = min(self.num_cache_queried_tokens, num_tokens)
        self.ready_ranges = [
            (a, min(b, num_tokens)) for a, b in self.ready_ranges if a < num_tokens
        ]
        self.external_end = min(self.external_end, num_tokens)
        if self.block_hashes:
            del self.block_hashes[num_tokens // self.hash_block_size :]
