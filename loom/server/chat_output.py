"""A chat choice's text as a chat completion gives it: a thinking model's reasoning split off
as `reasoning_content` (`reasoning.py`), then the content parsed for tool calls
(`tool_calls.py`: calls are looked for in the content only), as a whole `message` or as
stream `delta`s. Without a reasoning parser or tools the text is the content, as it was."""

from __future__ import annotations

from typing import Any

from loom.server import tool_calls
from loom.server.reasoning import ReasoningStream, split


def message(text: str, reasoning: ReasoningStream | None,
            names: frozenset[str] | None) -> dict[str, Any]:
    """A whole choice's `message` (`reasoning`: a fresh stream for this output, None without
    a parser; `names`: the offered tools' names, None when the text holds no calls).
    With a parser, `reasoning_content` is present (null without reasoning), and an output
    that is all reasoning has null content."""
    if reasoning is None:
        return tool_calls.message(text, names)
    thought, content = split(reasoning, text)
    body = tool_calls.message(content or "", names)
    if content is None and thought is not None:
        body["content"] = None
    return {**body, "reasoning_content": thought}


def usage(base: dict[str, int], reasoning_tokens: int | None) -> dict[str, Any]:
    """A chat completion's `usage`: `base`, with `completion_tokens_details` where a
    reasoning parser counted `reasoning_tokens`."""
    if reasoning_tokens is None:
        return base
    return {**base, "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}


class ChoiceDeltas:
    """One streamed choice: each step's text as `delta`s (reasoning first, then content and
    calls), and what the whole choice held (`reasoning_text`, `calls`)."""

    def __init__(self, reasoning: ReasoningStream | None,
                 names: frozenset[str] | None) -> None:
        self._reasoning = reasoning
        self._calls = tool_calls.ToolCallParser(names) if names else None
        self.reasoning_text = ""

    @property
    def calls(self) -> int:
        """Tool calls streamed so far."""
        return len(self._calls.calls) if self._calls is not None else 0

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas of a step's `text` (`finished`: the output ended with it; what was held
        back is given out)."""
        if self._reasoning is None:
            thought, content = "", text
        else:
            thought, content = self._reasoning.feed(text)
            if finished:
                more_thought, more_content = self._reasoning.finish()
                thought, content = thought + more_thought, content + more_content
        self.reasoning_text += thought
        out = [{"reasoning_content": thought}] if thought else []
        if self._calls is None:
            return out + ([{"content": content}] if content else [])
        before = len(self._calls.calls)
        pieces = self._calls.feed(content) + (self._calls.finish() if finished else [])
        return out + tool_calls.stream_deltas(pieces, before)
