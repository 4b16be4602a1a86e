"""What a harmony parser reports as an assistant's output streams: text deltas of the message
being written and each message once it ends, with the header fields that say where it goes."""

from __future__ import annotations

from dataclasses import dataclass

# How a message ended, by the token that ended it (None: the output ended inside it).
END_KINDS = ("end", "call", "return")


@dataclass(frozen=True)
class Header:
    """A message's header fields (None where the header has none): its channel
    ("analysis", "commentary", "final"), its recipient ("functions.NAME" on a call) and its
    content type ("<|constrain|>json" or "json" on a call)."""

    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None


@dataclass(frozen=True)
class HarmonyEvent:
    """One event of a parsed output, tagged with the header of the message it belongs to
    (all None for text outside any message: the model did not follow the format)."""

    channel: str | None
    recipient: str | None
    content_type: str | None


@dataclass(frozen=True)
class ContentDelta(HarmonyEvent):
    """Text the current message's content grew by: whole characters only (a character
    split across tokens comes when its last byte does)."""

    text: str


@dataclass(frozen=True)
class MessageDone(HarmonyEvent):
    """A message ended: its whole text (the concatenation of its ContentDelta texts) and
    `end`, one of END_KINDS, or None when the output ended inside the message."""

    text: str
    end: str | None
