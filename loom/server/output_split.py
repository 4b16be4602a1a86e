"""One chat output split into reasoning, content and tool calls, as it streams: the seam
between a model's output format and the APIs that give it out (chat completions' `message` and
`delta`s, the Responses API's items). Two formats:

- `TextSplit`: a think-tag model's reasoning (`reasoning.py`), then `<tool_call>` blocks in
  the answer (`tool_calls.py`). Text only; the token ids are not read.
- `HarmonySplit`: gpt-oss's harmony messages (`loom/harmony`), read from the token ids (the
  format's structure is special tokens, which the text leaves out). The `analysis` channel is
  reasoning; `final` is content; `commentary` addressed `to=functions.NAME` is a call when
  NAME is an offered tool (else its text is content, as an unknown call block is); other
  commentary (a preamble to calls) is content; text outside any message (a model that does
  not follow the format) is content.

Both give, for each step's delta, the reasoning text it completes and the content pieces and
calls it completes, in order; `finish` gives what was held. The pieces of all steps
concatenate to the whole output's split, whatever the steps.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Sequence
from typing import Protocol

from loom.harmony import ContentDelta, HarmonyParser, MessageDone
from loom.server.reasoning import ReasoningStream
from loom.server.tool_calls import ParsedCall, ToolCallParser

Piece = str | ParsedCall

ANALYSIS, COMMENTARY, FUNCTIONS = "analysis", "commentary", "functions."


class OutputSplit(Protocol):
    """One output's split; fed each step's delta in order, then finished once."""

    @property
    def calls(self) -> list[ParsedCall]:
        """The calls given out so far."""

    @property
    def reasoning_text(self) -> str:
        """The reasoning given out so far."""

    @property
    def splits_reasoning(self) -> bool:
        """Whether the format has reasoning at all (chat's `reasoning_content` is present,
        null when empty, only where it does)."""

    def feed(self, text: str, token_ids: Sequence[int]) -> tuple[str, list[Piece]]:
        """The (reasoning, pieces) a step's delta completes."""

    def finish(self) -> tuple[str, list[Piece]]:
        """What is still held once the output has ended."""

    def history(self, content: str) -> tuple[str, str | None]:
        """(content, reasoning_content) of the assistant message the next turn renders for
        this output whose content (calls aside) was `content`."""


class TextSplit:
    """Think tags, then tool-call blocks in the answer (`names`: the offered tools' names;
    None: the answer holds no calls). Without a reasoning stream the text is all answer."""

    def __init__(self, reasoning: ReasoningStream | None, names: frozenset[str] | None) -> None:
        self._reasoning = reasoning
        self._parser = ToolCallParser(names) if names else None
        self._thought: list[str] = []

    @property
    def calls(self) -> list[ParsedCall]:
        return self._parser.calls if self._parser is not None else []

    @property
    def reasoning_text(self) -> str:
        return "".join(self._thought)

    @property
    def splits_reasoning(self) -> bool:
        return self._reasoning is not None

    def feed(self, text: str, token_ids: Sequence[int]) -> tuple[str, list[Piece]]:
        thought, answer = ("", text) if self._reasoning is None else self._reasoning.feed(text)
        return self._out(thought, answer, finished=False)

    def finish(self) -> tuple[str, list[Piece]]:
        thought, answer = ("", "") if self._reasoning is None else self._reasoning.finish()
        return self._out(thought, answer, finished=True)

    def _out(self, thought: str, answer: str, finished: bool) -> tuple[str, list[Piece]]:
        self._thought.append(thought)
        if self._parser is None:
            return thought, [answer] if answer else []
        pieces = self._parser.feed(answer) if answer else []
        return thought, pieces + (self._parser.finish() if finished else [])

    def history(self, content: str) -> tuple[str, str | None]:
        # The text as generated: a think block before the answer, so that the next turn's
        # rendering shares the session's tokens (the template decides what it keeps).
        head = self._reasoning.head if self._reasoning is not None else ""
        return head + content, None


class HarmonySplit:
    """Harmony messages by channel (module docstring); `names`: the offered tools' names
    (None: no call is read, a call's text is content)."""

    def __init__(self, parser: HarmonyParser, names: frozenset[str] | None) -> None:
        self._parser = parser
        self._names = names or frozenset()
        self._calls: list[ParsedCall] = []
        self._thought: list[str] = []

    @property
    def calls(self) -> list[ParsedCall]:
        return self._calls

    @property
    def reasoning_text(self) -> str:
        return "".join(self._thought)

    @property
    def splits_reasoning(self) -> bool:
        return True

    def feed(self, text: str, token_ids: Sequence[int]) -> tuple[str, list[Piece]]:
        return self._read(self._parser.feed(token_ids))

    def finish(self) -> tuple[str, list[Piece]]:
        return self._read(self._parser.finish())

    def _called(self, recipient: str | None) -> str | None:
        """The offered function a message is addressed to, or None."""
        if recipient is None or not recipient.startswith(FUNCTIONS):
            return None
        name = recipient[len(FUNCTIONS):]
        return name if name in self._names else None

    def _read(self, events: list[ContentDelta | MessageDone]) -> tuple[str, list[Piece]]:
        thought: list[str] = []
        pieces: list[Piece] = []
        for event in events:
            name = self._called(event.recipient)
            if isinstance(event, ContentDelta):
                if event.channel == ANALYSIS and name is None:
                    thought.append(event.text)
                elif name is None and event.text:
                    pieces.append(event.text)
            elif name is not None and event.end is not None:
                # A call is given whole, once its message ended (a call cut by max_tokens
                # is dropped: its arguments are not whole).
                self._calls.append(ParsedCall(f"call_{uuid.uuid4().hex[:24]}", name,
                                              _arguments(event.text)))
                pieces.append(self._calls[-1])
        self._thought.extend(thought)
        return "".join(thought), _merged(pieces)

    def history(self, content: str) -> tuple[str, str | None]:
        # The harmony rendering keeps the reasoning only where the format does.
        return content, self.reasoning_text or None


def split_step(split: OutputSplit, text: str, token_ids: Sequence[int], finished: bool,
               ) -> tuple[str, list[Piece]]:
    """The (reasoning, pieces) of one step's delta through `split` (`finished`: the output
    ended with it, so what the split held is given out too); no piece is empty text."""
    thought, pieces = split.feed(text, token_ids)
    if finished:
        more_thought, more_pieces = split.finish()
        thought, pieces = thought + more_thought, pieces + more_pieces
    return thought, [p for p in pieces if p != ""]


def _arguments(text: str) -> str:
    """A call's arguments as compact JSON text when they are JSON, else as written."""
    with contextlib.suppress(ValueError):
        return json.dumps(json.loads(text), ensure_ascii=False)
    return text


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent content pieces joined."""
    out: list[Piece] = []
    for piece in pieces:
        if isinstance(piece, str) and out and isinstance(out[-1], str):
            out[-1] += piece
        else:
            out.append(piece)
    return out
