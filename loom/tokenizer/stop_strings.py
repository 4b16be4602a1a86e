"""`StopStringChecker`: find stop strings in streamed text, even when split across deltas."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopMatch(NamedTuple):
    """A stop string found in the text: keep `text[:kept_len]`, report `stop`."""

    kept_len: int
    stop: str


class StopStringChecker:
    """Stop-string search over accumulated output text, plus the streaming hold-back length."""

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stops if s))  # unique, non-empty, in order
        self._include = include_stop_str_in_output
        self._max_len = max((len(s) for s in self._stops), default=0)

    @property
    def stops(self) -> tuple[str, ...]:
        """The stop strings searched for (empty ones dropped)."""
        return self._stops

    @property
    def max_stop_len(self) -> int:
        """Length of the longest stop string."""
        return self._max_len

    def check(self, text: str, delta_len: int | None = None) -> StopMatch | None:
        """The earliest stop string in `text` that overlaps its last `delta_len` characters.

        With `delta_len=None` the whole text is searched. A stop string can begin up to
        `max_stop_len - 1` characters before the delta (split across deltas):

            text:  ..........[ max_stop_len-1 ][ delta_len ]
                             ^ search starts here
        """
        if not self._stops:
            return None
        start = 0
        if delta_len is not None:
            start = max(0, len(text) - delta_len - self._max_len + 1)
        best: StopMatch | None = None
        best_at = len(text) + 1
        for stop in self._stops:
            at = text.find(stop, start)
            if at != -1 and at < best_at:
                best_at = at
                best = StopMatch(at + len(stop) if self._include else at, stop)
        return best

    def truncate(self, text: str, delta_len: int | None = None) -> tuple[str, str] | None:
        """`(text cut at the stop string, stop string)` if `check` finds one, else None."""
        match = self.check(text, delta_len)
        if match is None:
            return None
        return text[: match.kept_len], match.stop

    def hold_back(self, text: str) -> int:
        """How many trailing characters of `text` must not be streamed yet.

        They are a proper prefix of some stop string, so the next delta may complete it and
        they would be cut. Zero when stop strings are kept in the output: then everything
        streamed is a prefix of the final text whatever comes next.
        """
        if self._include or not self._stops:
            return 0
        tail = text[-(self._max_len - 1) :] if self._max_len > 1 else ""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(tail)), longest, -1):
                if tail.endswith(stop[:k]):
                    longest = k
                    break
        return longest
