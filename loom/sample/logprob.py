"""`Logprob`: one token's log-probability with its rank and text, as vLLM's outputs hold it.

It IS the float: arithmetic, comparison, `float(x)`, `str(x)`, JSON encoding and pickling
treat it as the number it carries, so code that reads logprobs as floats keeps working,
while `.logprob`, `.rank` and `.decoded_token` are vLLM's fields. The sampler creates them
(it knows the ranks); the engine fills `decoded_token` as the outputs leave a step.
"""

from __future__ import annotations


class Logprob(float):
    """A logprob (the float itself) with `rank` (1 = the most likely token of its position;
    ties share the worst place) and `decoded_token` (the token's text; None until decoded)."""

    __slots__ = ("decoded_token", "rank")

    def __new__(cls, logprob: float, rank: int | None = None,
                decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        """The log-probability as a plain float."""
        return float(self)

    def __repr__(self) -> str:
        return (f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
                f"decoded_token={self.decoded_token!r})")

    # Printed (and formatted) as the number, as a float is.
    __str__ = float.__repr__
