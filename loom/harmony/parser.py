"""A harmony output parsed by channel as it streams: token ids in, `ContentDelta` and
`MessageDone` events out (`events.py`).

The parser starts after the generation prompt `<|start|>assistant`, so the first message's
header (`<|channel|>analysis`) comes without a `<|start|>` of its own; later messages open
with `<|start|>`. Every token is either structure or text:

- structure: a header that parses (`<|start|>`, the header's tokens, `<|message|>`) and the
  token that ends a message (`<|end|>`, `<|call|>`, `<|return|>`);
- text: everything else. Inside a message it is the message's content (a special token
  there is its spelled-out text, as the package reads it). Outside any message it is a
  message with no header fields (channel None): a token where a `<|start|>` should be, a
  header that does not parse (with its `<|start|>` and `<|message|>`), a header the output
  ends in or that an end token cuts; such a message runs to the next `<|start|>` (which
  ends it with `end` None and opens a header) or end token. An end token outside any
  message ends nothing and is dropped.

The parser never raises on what a model wrote. Text is decoded as UTF-8 across tokens: a
character split between tokens comes whole with the token that completes it; invalid
bytes become U+FFFD (the package's parser gives the text after an invalid byte with the
next token; the message's text is the same); a message the output ends inside gets its
held bytes, as U+FFFD, before its MessageDone. What a backend supplies (token bytes,
header parsing) is a `TokenReader`: Loom's own (`reader.py`) or the openai-harmony
package's (`package.py`).
"""

from __future__ import annotations

import codecs
import enum
from collections.abc import Sequence
from typing import Protocol

from loom.harmony.events import ContentDelta, HarmonyEvent, Header, MessageDone
from loom.harmony.tokens import HarmonyIds

_NO_HEADER = Header()  # text outside any message


class TokenReader(Protocol):
    """A backend's part of parsing: its special ids, token bytes, header fields."""

    @property
    def ids(self) -> HarmonyIds:
        """The vocabulary's harmony special token ids."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` stands for (a special token's spelled-out text)."""
        ...

    def header(self, token_ids: Sequence[int], role_known: bool) -> Header | None:
        """The fields of the header written by `token_ids` (those between `<|start|>` and
        `<|message|>`), None when it is not a valid header; `role_known`: the first header
        of an output, whose role (assistant) the prompt wrote."""
        ...


class _State(enum.Enum):
    BETWEEN = "between"  # after a message: a <|start|> is due
    HEADER = "header"  # reading a header up to <|message|>
    CONTENT = "content"  # inside a message with a parsed header
    STRAY = "stray"  # inside text outside any message (no header fields)


class HarmonyParser:
    """One assistant output's tokens, fed as they come, read into events (module docstring).

    Invariants: `_pending` holds the tokens of the header being read (its `<|start|>`
    included when the output wrote one) and is empty outside HEADER; `_parts` holds the
    current message's text given out so far (its ContentDelta texts)."""

    def __init__(self, reader: TokenReader, start: Header | None = None) -> None:
        """`start`: the header of a message the prompt opened (a forced header: the prompt
        ends in its `<|message|>`), so the output starts inside that message's content."""
        self._reader = reader
        ids = reader.ids
        self._start, self._message = ids.start, ids.message
        self._ends = ids.end_kinds
        self._pending: list[int] = []
        self._role_known = True
        self._header = start or _NO_HEADER
        self._state = _State.HEADER if start is None else _State.CONTENT
        self._new_text()

    def feed(self, token_ids: Sequence[int]) -> list[HarmonyEvent]:
        """The events `token_ids` (the output's next tokens) complete."""
        events: list[HarmonyEvent] = []
        for token in token_ids:
            self._step(int(token), events)
        return events

    def finish(self) -> list[HarmonyEvent]:
        """The events the output's end completes: the message it ended inside (`end`
        None), or an unfinished header's text as a message without header fields."""
        events: list[HarmonyEvent] = []
        if self._state is _State.HEADER and self._pending:
            self._stray(self._pending, events)
        if self._state in (_State.CONTENT, _State.STRAY):
            self._close(None, events)
        self._pending = []
        self._state = _State.BETWEEN
        return events

    def _step(self, token: int, events: list[HarmonyEvent]) -> None:
        state = self._state
        end = self._ends.get(token)
        if state is _State.HEADER:
            if token == self._message:
                self._open(token, events)
            elif end is not None:
                if self._pending:
                    self._stray(self._pending, events)
                    self._close(end, events)
                self._pending = []
                self._state = _State.BETWEEN
            else:
                self._pending.append(token)
        elif end is not None:
            if state is not _State.BETWEEN:
                self._close(end, events)
            self._state = _State.BETWEEN
        elif token == self._start and state is not _State.CONTENT:
            if state is _State.STRAY:
                self._close(None, events)
            self._pending, self._role_known = [token], False
            self._state = _State.HEADER
        elif state is _State.BETWEEN:
            self._stray([token], events)
        else:
            self._text(self._reader.token_bytes(token), events)

    def _open(self, message_token: int, events: list[HarmonyEvent]) -> None:
        """At `<|message|>`: the pending header opens a message, or is text if invalid."""
        pending, self._pending = self._pending, []
        body = pending[1:] if not self._role_known else pending
        header = self._reader.header(body, self._role_known)
        if header is None:
            self._stray([*pending, message_token], events)
            return
        self._header, self._state = header, _State.CONTENT

    def _stray(self, tokens: Sequence[int], events: list[HarmonyEvent]) -> None:
        """Open a message without header fields whose text starts with `tokens`'."""
        self._header, self._state = _NO_HEADER, _State.STRAY
        self._text(b"".join(self._reader.token_bytes(t) for t in tokens), events)

    def _new_text(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._parts: list[str] = []

    def _text(self, data: bytes, events: list[HarmonyEvent]) -> None:
        self._emit(self._decoder.decode(data), events)

    def _emit(self, text: str, events: list[HarmonyEvent]) -> None:
        if text:
            h = self._header
            self._parts.append(text)
            events.append(ContentDelta(h.channel, h.recipient, h.content_type, text))

    def _close(self, end: str | None, events: list[HarmonyEvent]) -> None:
        """End the current message (`end`: how, None when the output ended inside it)."""
        self._emit(self._decoder.decode(b"", final=True), events)
        h = self._header
        events.append(MessageDone(h.channel, h.recipient, h.content_type,
                                  "".join(self._parts), end))
        self._new_text()
