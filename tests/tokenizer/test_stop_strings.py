"""Stop strings found across deltas, truncation, and the streaming hold-back."""

from __future__ import annotations

import random

import pytest

from loom.tokenizer import StopMatch, StopStringChecker


def _feed(checker: StopStringChecker, deltas: list[str]) -> tuple[str, StopMatch | None]:
    text = ""
    for delta in deltas:
        text += delta
        match = checker.check(text, len(delta))
        if match is not None:
            return text, match
    return text, None


def test_stop_split_across_deltas() -> None:
    checker = StopStringChecker(["STOP"], include_stop_str_in_output=False)
    text, match = _feed(checker, ["hello S", "T", "OP and more"])
    assert match == StopMatch(len("hello "), "STOP")
    assert text[: match.kept_len] == "hello "
    assert checker.truncate(text, len("OP and more")) == ("hello ", "STOP")


def test_include_stop_in_output() -> None:
    checker = StopStringChecker(["</end>"], include_stop_str_in_output=True)
    _, match = _feed(checker, ["ab</", "en", "d>cd"])
    assert match == StopMatch(len("ab</end>"), "</end>")


def test_earliest_stop_wins_and_old_text_is_not_rescanned() -> None:
    checker = StopStringChecker(["world", "lo w"])
    assert checker.check("hello world", None) == StopMatch(3, "lo w")
    # A stop wholly before the last delta's reach is not reported again.
    assert checker.check("xx world" + "y" * 20, 5) is None
    assert checker.check("no stop here", 4) is None


def test_empty_and_duplicate_stops_are_ignored() -> None:
    checker = StopStringChecker(["", "a", "a"])
    assert checker.stops == ("a",)
    assert StopStringChecker([]).check("anything", 3) is None
    assert StopStringChecker([]).hold_back("anything") == 0


def test_hold_back() -> None:
    checker = StopStringChecker(["STOP", "\n\n"], include_stop_str_in_output=False)
    assert checker.hold_back("text ST") == 2
    assert checker.hold_back("text S") == 1
    assert checker.hold_back("text STO") == 3
    assert checker.hold_back("text\n") == 1
    assert checker.hold_back("text STOx") == 0
    assert checker.hold_back("") == 0
    assert StopStringChecker(["STOP"], include_stop_str_in_output=True).hold_back("a ST") == 0


@pytest.mark.parametrize("include", [False, True])
def test_streamed_text_never_shows_a_partial_stop(include: bool) -> None:
    """Simulate a streaming client: what it sees is always a prefix of the final output."""
    rng = random.Random(0)
    stops = ["<|end|>", "ab", "xyz"]
    alphabet = ["a", "b", "x", "y", "z", "<|", "end", "|>", " ", "q"]
    for _ in range(300):
        checker = StopStringChecker(stops, include_stop_str_in_output=include)
        text, shown, final = "", "", None
        for _ in range(rng.randint(1, 15)):
            delta = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
            text += delta
            match = checker.check(text, len(delta))
            if match is not None:
                final = text[: match.kept_len]
                break
            visible = text[: len(text) - checker.hold_back(text)]
            assert visible.startswith(shown)
            shown = visible
        final = text if final is None else final
        assert final.startswith(shown)
        if not include:
            assert not any(s in final for s in stops)
