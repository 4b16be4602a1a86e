"""`SpeculativeConfig`: how the engine drafts tokens for speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from loom.errors import InvalidRequestError

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt-lookup ("ngram") drafting, with vLLM's names.

    Each step, a generating sequence whose last `n` tokens (`prompt_lookup_min <= n <=
    prompt_lookup_max`, longest first) occurred earlier in its own tokens gets up to
    `num_speculative_tokens` drafts: the tokens that followed that earlier occurrence. One
    forward scores the drafts; the accepted ones cost no step of their own. Outputs are the
    same as without speculation (drafts are checked against what the sampler draws).
    `disable_by_batch_size`: no drafts while this many requests or more are running (a large
    batch already uses the weights it reads; extra rows there cost compute).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidRequestError(
                f"unknown speculative method {self.method!r}; choose one of {list(METHODS)}"
            )
        if self.num_speculative_tokens < 1:
            raise InvalidRequestError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidRequestError(
                "speculative ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise InvalidRequestError(
                f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        """Build from a `speculative_config` dict, naming unknown keys."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}"
            )
        return cls(**values)
