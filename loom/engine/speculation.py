"""Speculative decoding in the engine: drafting before a step, verifying after it.

The scheduler's rule does the rest: drafts are appended to a decoding request's tokens
(`Request.add_draft_tokens`), so the step computes the pending token and every draft in one
chunk and returns a logits row for each. Verification samples every row exactly as plain
decoding would sample that position, and keeps tokens while they match the drafts:

    tokens:   ... p | d1  d2  d3          (p: last sampled token, d: drafts)
    rows:         L0  L1  L2  L3          (L_i: logits after p, d1, .., d_i)
    sampled:      t0  t1  t2  t3          t_i drawn from L_i as if d1..d_i were generated
    kept:         t0 (= d1) t1 (= d2) t2  first mismatch: t2 != d3; t3 is discarded

Every kept t_i is what plain decoding would have produced (its row saw the same history),
so the output is unchanged: greedy exactly, seeded sampling too (the generator is rewound
to the draws of the kept rows), and a random draft never biases the distribution.
"""

from __future__ import annotations

from loom.engine.sequence import SequenceState
from loom.spec_decode import NgramProposer, SpeculativeConfig


def kept_tokens(sampled: list[int], draft: list[int]) -> list[int]:
    """The sampled tokens a step keeps: up to and including the first that differs from its
    draft (all k + 1 when every draft matched)."""
    for i, token in enumerate(draft):
        if sampled[i] != token:
            return sampled[: i + 1]
    return sampled[: len(draft) + 1]


class Speculator:
    """Proposes drafts for the sequences that decode next step."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(config)
        # Engine-wide counts: draft tokens scored, and those the sampler agreed with.
        self.num_drafted = 0
        self.num_accepted = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted share of the drafted tokens so far (0 before any draft)."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    def enabled_for(self, num_running: int) -> bool:
        """False while the batch is at least `disable_by_batch_size` requests."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running < limit

    def propose(self, seq: SequenceState, max_model_len: int) -> None:
        """Append drafts to a sequence about to decode one token, within its limits."""
        request, params = seq.request, seq.params
        if (
            request.num_uncomputed_tokens != 1
            or request.num_draft_tokens
            or not (request.sample_when_computed and seq.generating)
            or seq.blocked
            or params.logits_processors  # user callables: never call them on guesses
        ):
            return
        if seq.draft_pause > 0:
            seq.draft_pause -= 1
            return
        # Tokens the step may produce (drafts + 1) stay within max_tokens and the context.
        limit = self._limit(seq)
        room = min(limit, max_model_len - request.num_tokens - 1)
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - len(seq.segment_token_ids) - 1)
        draft = self.proposer.propose(request.token_ids, room)
        if draft:
            request.add_draft_tokens(draft)

    def _limit(self, seq: SequenceState) -> int:
        """Most drafts the sequence may get now: half the configured number at first."""
        if seq.draft_limit is None:
            return (self.config.num_speculative_tokens + 1) // 2
        return seq.draft_limit

    def observe(self, seq: SequenceState, num_drafts: int, num_accepted: int) -> None:
        """Adapt the sequence's drafting to how its drafts fare.

        A rejected draft costs a row of compute for nothing (a step with k drafts costs
        about 1 + k / 4 plain steps here), so: two more drafts after a full match (at most
        num_speculative_tokens), one more than were accepted after a miss, and after a
        single draft that missed, no drafts for the next `_PAUSE_STEPS` steps.
        """
        if num_drafts == 0:
            return
        self.num_drafted += num_drafts
        self.num_accepted += num_accepted
        most = self.config.num_speculative_tokens
        if num_accepted == num_drafts:
            seq.draft_limit = min(most, self._limit(seq) + 2)
        else:
            seq.draft_limit = min(most, num_accepted + 1)
            if num_drafts == 1:
                seq.draft_pause = _PAUSE_STEPS


# Steps without drafts after a single draft was rejected: probing costs at most
# 1 / (_PAUSE_STEPS + 1) of the rows a miss wastes, on text that does not repeat.
_PAUSE_STEPS = 4
