"""Reasoning parsers: a think-tag model's output split into its reasoning (vLLM's
`reasoning_content`) and its answer, as a whole or as it streams.

Qwen3 and DeepSeek-R1 write `<think>reasoning</think>answer`; a chat template may write the
opening tag itself (the generation prompt ends in `<think>`: the output starts inside the
block) or a whole empty block (`enable_thinking: false`: the prompt ends in `</think>`). One
rule for both parsers, applied alike to a whole output and to its deltas:

- the prompt closed a block: the output is all answer, tags and all;
- else the output starts inside a block when the prompt opened one, or, for `deepseek_r1`
  (whose outputs may omit the opening tag), always; a `qwen3` output whose prompt neither
  opened nor closed one starts outside, and enters a block only by opening with `<think>`
  (after whitespace, which is then dropped);
- an opening `<think>` at the start of a block is dropped; the block runs to the first
  `</think>` (dropped); everything after it is answer, verbatim. A block the output never
  closes (`max_tokens` cut it) is all reasoning.

A constrained output (a grammar, a forced tool call) starts outside a block whatever the
prompt says: the grammar chooses its text from the first token, so it holds reasoning only
where it writes `<think>` itself. Streaming holds back only what may still become a tag.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from loom.errors import InvalidRequestError

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# `--reasoning-parser` values: "auto" picks qwen3 for a template that thinks, else none.
PARSER_CHOICES = ("auto", "qwen3", "deepseek_r1", "none")
# What in a chat template says that the model thinks in tags.
_THINKING_TEMPLATE_MARKS = (THINK_OPEN, "enable_thinking")


class PromptThinking(enum.Enum):
    """What a prompt's end leaves of a think block."""

    OPEN = "open"  # ends in <think>: the output starts inside the block
    CLOSED = "closed"  # ends in </think> (an empty block pre-filled): no reasoning follows
    NONE = "none"  # neither: the output decides


def prompt_thinking(prompt_tail: str) -> PromptThinking:
    """What the end of a prompt's text (trailing whitespace aside) does to a think block."""
    tail = prompt_tail.rstrip()
    if tail.endswith(THINK_OPEN):
        return PromptThinking.OPEN
    if tail.endswith(THINK_CLOSE):
        return PromptThinking.CLOSED
    return PromptThinking.NONE


class _Mode(enum.Enum):
    OPENING = "opening"  # at the start: whitespace and a prefix of <think> are held
    REASONING = "reasoning"  # inside the block: a prefix of </think> is held
    CONTENT = "content"  # after it (or none): everything is answer


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag` (to hold)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """One output's text, fed as it comes, split into (reasoning, content) deltas.

    Invariant: `_pending` is text fed and not yet given out (only in OPENING and REASONING
    modes); the content given out is always the last `_content_chars` characters of the
    text fed, so what precedes it (`head`) is the reasoning section as generated."""

    def __init__(self, inside: bool) -> None:
        """`inside`: whether the output is read as starting inside a think block before it
        opens one itself (where it does not, it is all content)."""
        self._inside = inside
        self._mode = _Mode.OPENING
        self._pending = ""
        self._fed: list[str] = []
        self._content_chars = 0

    @classmethod
    def content_only(cls) -> ReasoningStream:
        """A stream that gives every character to the content."""
        stream = cls(inside=False)
        stream._mode = _Mode.CONTENT
        return stream

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that `text` completes."""
        self._fed.append(text)
        if self._mode is _Mode.CONTENT:
            return "", self._content(text)
        self._pending += text
        reasoning = ""
        if self._mode is _Mode.OPENING:
            start = self._pending.lstrip()
            if THINK_OPEN.startswith(start) and len(start) < len(THINK_OPEN):
                return "", ""  # still whitespace, or the start of <think>
            if start.startswith(THINK_OPEN):
                self._pending = start[len(THINK_OPEN):]
            elif not self._inside:
                text, self._pending, self._mode = self._pending, "", _Mode.CONTENT
                return "", self._content(text)
            self._mode = _Mode.REASONING
        end = self._pending.find(THINK_CLOSE)
        if end >= 0:
            reasoning = self._pending[:end]
            rest = self._pending[end + len(THINK_CLOSE):]
            self._pending, self._mode = "", _Mode.CONTENT
            return reasoning, self._content(rest)
        keep = _partial_tag(self._pending, THINK_CLOSE)
        reasoning = self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """What is still held once the output has ended: an unclosed block's tail is
        reasoning; held whitespace or a partial <think> goes where the output started."""
        rest, self._pending = self._pending, ""
        if self._mode is _Mode.REASONING or (self._mode is _Mode.OPENING and self._inside):
            return rest, ""
        return "", self._content(rest)

    @property
    def head(self) -> str:
        """The output's text before its content, tags included (as generated)."""
        fed = "".join(self._fed)
        return fed[:len(fed) - self._content_chars]

    def _content(self, text: str) -> str:
        self._content_chars += len(text)
        return text


@dataclass(frozen=True)
class ReasoningParser:
    """A think-tag parser: `qwen3`, or `deepseek_r1` (an output reads as starting inside a
    block even when its prompt did not open one)."""

    name: str
    inside_by_default: bool

    def stream(self, thinking: PromptThinking, constrained: bool = False) -> ReasoningStream:
        """A stream for one output of a prompt that leaves `thinking`; `constrained`: the
        output follows a grammar (it starts outside a block, see the module docstring)."""
        if thinking is PromptThinking.CLOSED:
            return ReasoningStream.content_only()
        inside = not constrained and (thinking is PromptThinking.OPEN or self.inside_by_default)
        return ReasoningStream(inside)


_PARSERS = {"qwen3": ReasoningParser("qwen3", False),
            "deepseek_r1": ReasoningParser("deepseek_r1", True)}


def thinks(template_text: str | None) -> bool:
    """Whether a chat template is a think-tag model's (mentions <think> or enable_thinking)."""
    return template_text is not None and any(m in template_text
                                             for m in _THINKING_TEMPLATE_MARKS)


def select_parser(name: str, template_text: str | None) -> ReasoningParser | None:
    """The parser `--reasoning-parser name` selects (None: the output is all content);
    "auto" is qwen3 for a chat template that `thinks`. Any other name is an
    InvalidRequestError naming the choices."""
    if name not in PARSER_CHOICES:
        raise InvalidRequestError(f"unknown reasoning parser {name!r}; choose one of "
                                  f"{', '.join(PARSER_CHOICES)}", param="reasoning_parser",
                                  code="invalid_value")
    if name == "auto":
        return _PARSERS["qwen3"] if thinks(template_text) else None
    return _PARSERS.get(name)
