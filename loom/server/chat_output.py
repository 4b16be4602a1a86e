"""A chat choice's output as a chat completion gives it, split by its format
(`output_split.py`: a thinking model's reasoning as `reasoning_content`, then the content
and tool calls), as a whole `message` or as stream `delta`s. Without reasoning or tools the
text is the content, as it was."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loom.server import tool_calls
from loom.server.output_split import OutputSplit, split_step


def message(split: OutputSplit, text: str, token_ids: Sequence[int],
            with_calls: bool) -> dict[str, Any]:
    """A whole choice's `message` through a fresh `split` (`with_calls`: tools were offered,
    so content is null when calls come without text). Where the format has reasoning,
    `reasoning_content` is present (null without reasoning), and an output that is all
    reasoning has null content."""
    thought, pieces = split_step(split, text, token_ids, finished=True)
    content = "".join(p for p in pieces if isinstance(p, str))
    body = tool_calls.assistant_message(content, split.calls, with_calls)
    if not split.splits_reasoning:
        return body
    if not content and thought:
        body["content"] = None
    return {**body, "reasoning_content": thought or None}


def usage(base: dict[str, int], reasoning_tokens: int | None) -> dict[str, Any]:
    """A chat completion's `usage`: `base`, with `completion_tokens_details` where a
    reasoning parser counted `reasoning_tokens`."""
    if reasoning_tokens is None:
        return base
    return {**base, "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}


class ChoiceDeltas:
    """One streamed choice: each step's delta as chat `delta`s (reasoning first, then content
    and calls), and what the whole choice held (`reasoning_text`, `calls`)."""

    def __init__(self, split: OutputSplit) -> None:
        self._split = split

    @property
    def calls(self) -> int:
        """Tool calls streamed so far."""
        return len(self._split.calls)

    @property
    def reasoning_text(self) -> str:
        """The reasoning streamed so far."""
        return self._split.reasoning_text

    def deltas(self, text: str, token_ids: Sequence[int], finished: bool
               ) -> list[dict[str, Any]]:
        """The deltas of a step's `text` and `token_ids` (`finished`: the output ended with
        it; what was held back is given out)."""
        before = len(self._split.calls)
        thought, pieces = split_step(self._split, text, token_ids, finished)
        out = [{"reasoning_content": thought}] if thought else []
        return out + tool_calls.stream_deltas(pieces, before)

