"""OpenAI's tool calling on the response side: a choice's text parsed for calls in the call
format (`tools.py`), as a whole or as it streams, and the shapes calls take in responses.

A block `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` whose JSON names an
offered function and whose arguments are an object (or the JSON text of one) is a call; any
other block stays in the content, verbatim, and so does a block the output ends inside
(`max_tokens` cut it). Whitespace between calls, and at the start before anything else, is
not content. Streaming holds back text that may still be the start of a block and a block
until it closes, then sends the whole call in one `tool_calls` delta; the content deltas
concatenate to exactly the whole response's content.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


def format_call(name: str, arguments: Any) -> str:
    """One call in the call format; `arguments` an object, or JSON text (kept as given
    when it is not JSON)."""
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}{body}{CALL_CLOSE}"


@dataclass(frozen=True)
class ParsedCall:
    """A call found in the output: OpenAI's id, the function's name, the arguments' JSON."""

    id: str
    name: str
    arguments: str

    def as_dict(self) -> dict[str, Any]:
        """OpenAI's `tool_calls` entry."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _parse_block(body: str, names: frozenset[str]) -> ParsedCall | None:
    """The call a block's JSON describes, or None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(f"call_{uuid.uuid4().hex[:24]}", value["name"],
                      json.dumps(arguments, ensure_ascii=False))


def _held_prefix(text: str) -> int:
    """Length of the longest end of `text` that begins CALL_OPEN (it must wait)."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """One choice's text, fed as it comes, split into content and calls.

    Invariant: `_pending` is text not yet given out: inside a block (`_in_block`) it is the
    block's body so far; outside, a tail that may begin CALL_OPEN. `_space` holds whitespace
    that follows a call (or the start) until something other than a call follows it."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.calls: list[ParsedCall] = []
        self._pending = ""
        self._in_block = False
        self._space: str | None = ""  # None: not after a call or the start

    def feed(self, text: str) -> list[str | ParsedCall]:
        """What `text` completes: content pieces and calls, in order."""
        out: list[str | ParsedCall] = []
        self._pending += text
        while True:
            if self._in_block:
                end = self._pending.find(CALL_CLOSE)
                if end < 0:
                    return out
                body, self._pending = self._pending[:end], self._pending[end + len(CALL_CLOSE):]
                self._in_block = False
                call = _parse_block(body, self.names)
                if call is None:
                    self._content(f"{CALL_OPEN}{body}{CALL_CLOSE}", out)
                else:
                    self.calls.append(call)
                    self._space = ""
                    out.append(call)
                continue
            start = self._pending.find(CALL_OPEN)
            if start >= 0:
                self._content(self._pending[:start], out)
                self._pending = self._pending[start + len(CALL_OPEN):]
                self._in_block = True
                continue
            keep = _held_prefix(self._pending)
            self._content(self._pending[:len(self._pending) - keep], out)
            self._pending = self._pending[len(self._pending) - keep:]
            return out

    def finish(self) -> list[str | ParsedCall]:
        """The rest once the output has ended: an unclosed block or held text as content."""
        out: list[str | ParsedCall] = []
        rest = (CALL_OPEN if self._in_block else "") + self._pending
        self._pending, self._in_block = "", False
        self._content(rest, out)
        return out

    def _content(self, text: str, out: list[str | ParsedCall]) -> None:
        if not text:
            return
        if self._space is not None:
            self._space += text
            if not self._space.strip():
                return
            text, self._space = self._space, None
        out.append(text)


def finish_reason(reason: str | None, calls: int) -> str | None:
    """OpenAI's finish reason: "tool_calls" when the output ended by itself with calls."""
    return "tool_calls" if calls and reason == "stop" else reason


def parse_whole(text: str, names: frozenset[str]) -> tuple[str | None, list[ParsedCall]]:
    """A whole output's content (None when there is none) and calls."""
    parser = ToolCallParser(names)
    pieces = [*parser.feed(text), *parser.finish()]
    content = "".join(p for p in pieces if isinstance(p, str))
    return content or None, parser.calls


def message(text: str, names: frozenset[str] | None) -> dict[str, Any]:
    """A chat choice's `message`: the text as content, or (with tool names) parsed."""
    if names is None:
        return assistant_message(text, [], with_calls=False)
    content, calls = parse_whole(text, names)
    return assistant_message(content or "", calls, with_calls=True)


def assistant_message(content: str, calls: list[ParsedCall], with_calls: bool,
                      ) -> dict[str, Any]:
    """A chat `message` of an output's content and calls: beside calls, empty content is
    null; without calls it is the content as it is (`with_calls`: tools were offered, and
    there an absent content is "")."""
    if calls:
        return {"role": "assistant", "content": content or None,
                "tool_calls": [c.as_dict() for c in calls]}
    return {"role": "assistant", "content": content or "" if with_calls else content}


def stream_deltas(pieces: list[str | ParsedCall], first_index: int) -> list[dict[str, Any]]:
    """Chat `delta`s of parsed pieces: adjacent content merged, one delta per call (indexed
    from `first_index`, the calls this choice streamed before)."""
    deltas: list[dict[str, Any]] = []
    index = first_index
    for piece in pieces:
        if isinstance(piece, str):
            if deltas and "content" in deltas[-1]:
                deltas[-1]["content"] += piece
            else:
                deltas.append({"content": piece})
        else:
            deltas.append({"tool_calls": [{"index": index, **piece.as_dict()}]})
            index += 1
    return deltas
