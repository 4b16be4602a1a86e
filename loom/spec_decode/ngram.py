"""`NgramProposer`: drafts copied from where the sequence's latest n-gram occurred before."""

from __future__ import annotations

from collections.abc import Sequence

from loom.spec_decode.config import SpeculativeConfig


class NgramProposer:
    """Prompt lookup: match the last tokens against the earlier ones, propose what followed.

        token_ids:  ... a b c x y z ... a b c |        (suffix "a b c", n = 3)
                        ^^^^^ ^^^^^         proposal: x y z (up to max_tokens of them)

    The longest suffix (up to `prompt_lookup_max`) that occurred before wins, and among equal
    lengths the latest occurrence. A proposal that runs into the suffix itself continues with
    its own tokens, so a repeating cycle is followed around (`a b a b` proposes `a b a b`).
    Cost: one C-speed scan of the tokens for the last token's occurrences, then Python work
    per occurrence (at most `prompt_lookup_max` comparisons each).
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` draft tokens to follow `token_ids`; empty when nothing matches."""
        end = len(token_ids)
        if max_tokens < 1 or end < self.min_n + 1:
            return []
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        last = ids[-1]
        best, best_len = -1, 0
        at = ids.index(last)
        while at < end - 1:  # `at` is an earlier occurrence of the last token
            length = 1
            while (
                length < self.max_n and length <= at
                and ids[at - length] == ids[end - 1 - length]
            ):
                length += 1
            if length >= best_len:  # later occurrences win ties
                best, best_len = at, length
            at = ids.index(last, at + 1)
        if best < 0 or best_len < self.min_n:
            return []
        draft: list[int] = []
        for i in range(best + 1, best + 1 + max_tokens):
            draft.append(ids[i] if i < end else draft[i - end])
        return draft
