"""What the scheduler hands to the model runner for one engine step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loom.core.kv_transfer import LoadFailure


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's contiguous range of tokens to compute in this step (a request whose K/V
    was loaded with gaps may have several, one per gap, in position order).

    The chunk covers positions [start_pos, start_pos + len(token_ids)) of the request:

        token_ids of the request:  t0 t1 ... t(start_pos-1) | t(start_pos) ... t(end-1) | (not yet)
                                   \\____ K/V in cache ____/ \\______ this chunk ______/

    Attention for the chunk reads K/V of positions [0, end) through `block_ids`, whose
    blocks cover at least `end` slots. Slot of position p: block_ids[p // B] * B + p % B.

    A chunk that reaches the end of its request's tokens needs logits: for its last token,
    and with speculative drafts (always the chunk's last `num_draft_tokens` tokens) for the
    token before them and each of them, `num_logits` rows in position order.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    needs_logits: bool
    num_draft_tokens: int = 0
    # A prompt chunk of a request that wants prompt logprobs: a logits row for every token
    # (the sampling rows, if any, are still the last `num_sample_logits`).
    all_logits: bool = False
    # A pooling request's chunk ("last" or "mean"; None: a generating one): no logits, one
    # pooled row instead (`ModelOutput.pooled`); it pools the last token only when the
    # chunk ends the request's tokens (`end_pos`).
    pooling: str | None = None

    @property
    def num_sample_logits(self) -> int:
        """Rows to sample from (or store): 0, or 1 plus one per draft token."""
        return 1 + self.num_draft_tokens if self.needs_logits else 0

    @property
    def num_logits(self) -> int:
        """Logits rows this chunk yields, for its last tokens in position order: every
        token's with `all_logits`, else `num_sample_logits`."""
        return len(self.token_ids) if self.all_logits else self.num_sample_logits

    @property
    def end_pos(self) -> int:
        """One past the last position computed by this chunk."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class Unschedulable:
    """A request that can never hold the blocks its tokens need: pinned idle sessions keep
    the rest of the pool, and no preemption or eviction can free them for it."""

    request_id: str
    blocks_needed: int
    blocks_available: int


@dataclass(frozen=True)
class FilledBlock:
    """A block whose tokens are all computed once this step's forward ran (drafts excluded),
    with its prefix-cache key: what a KV connector saves."""

    request_id: str
    block_index: int  # in the request's table; tokens [index * B, (index + 1) * B)
    block_id: int
    block_hash: bytes


@dataclass
class SchedulerOutput:
    """The batch of one step: chunks in scheduling order (decodes first, then prefills)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # (src, dst) KV block copies to perform before the forward (copy-on-write of forks).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Tokens computed again that had been computed before (after preemption).
    num_recomputed_tokens: int = 0
    # Requests the engine must fail: waiting or preempting would never make them fit.
    unschedulable: list[Unschedulable] = field(default_factory=list)
    # KV connector: requests whose external K/V the runner loads in this step (they compute
    # nothing until the outcome is known), and the connector's opaque per-step metadata.
    loading_request_ids: list[str] = field(default_factory=list)
    kv_connector_metadata: Any = None
    # With a connector: the blocks this step's chunks fill, for it to save.
    filled_blocks: list[FilledBlock] = field(default_factory=list)
    # Tokens computed in gaps of external K/V (the store lacked them or their load failed).
    num_gap_tokens: int = 0
    # Requests whose load cannot succeed, known while scheduling (the scheduler half of the
    # connector raised while planning it): request id -> why. Settled after the step as if
    # every block of the load failed for that reason.
    failed_load_plans: dict[str, str] = field(default_factory=dict)
    # Requests whose load failed under kv_load_failure_policy="fail" (set after the step).
    load_failures: list[LoadFailure] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed in this step across all chunks."""
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to run."""
        return not self.chunks and not self.block_copies and not self.loading_request_ids
