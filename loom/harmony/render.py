"""Loom's own harmony renderer: messages to token ids with any Loom tokenizer whose
vocabulary carries the harmony special tokens, token for token as the openai-harmony
package renders them when the vocabulary is o200k (the package's tests prove it).

A message is `<|start|>{author}{header}<|message|>{content}<|end|>` (`<|call|>` instead of
`<|end|>` for an assistant's message with a recipient), where the author is the role (a
tool message: its author's name) and the header is ` to={recipient}`, `<|channel|>{channel}`
and the content type (` <|constrain|>json`: a space, the special token, then the rest).
Each text piece is encoded on its own, as the package does, and as ordinary text: a
special token's spelling inside a message's text stays text, never the special token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer as HFTokenizer

from loom.harmony.conversation import HarmonyMessage
from loom.harmony.tokens import HarmonyIds
from loom.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True)
class Special:
    """A special token in a rendering (by its spelling, e.g. "<|start|>")."""

    name: str


START, END, MESSAGE = Special("<|start|>"), Special("<|end|>"), Special("<|message|>")
CHANNEL, CONSTRAIN, CALL = Special("<|channel|>"), Special("<|constrain|>"), Special("<|call|>")

Segment = str | Special


def header_segments(channel: str | None, recipient: str | None,
                    content_type: str | None) -> list[Segment]:
    """A header's pieces after the author, up to (not including) `<|message|>`."""
    out: list[Segment] = []
    if recipient is not None and recipient != "all":
        out.append(f" to={recipient}")
    if channel is not None:
        out += [CHANNEL, channel]
    if content_type is not None:
        if content_type.startswith(CONSTRAIN.name):
            out += [" ", CONSTRAIN, content_type[len(CONSTRAIN.name):]]
        else:
            out.append(f" {content_type}")
    return out


def message_segments(message: HarmonyMessage) -> list[Segment]:
    """One message's pieces (module docstring)."""
    if message.role == "tool":
        author: list[Segment] = [message.author_name or ""]
    else:
        author = [message.role] + ([f":{message.author_name}"] if message.author_name else [])
    call = message.role == "assistant" and message.recipient is not None
    return [START, *author,
            *header_segments(message.channel, message.recipient, message.content_type),
            MESSAGE, message.content, CALL if call else END]


def conversation_segments(messages: Sequence[HarmonyMessage],
                          add_generation_prompt: bool) -> list[Segment]:
    """The pieces of `messages` in order, then `<|start|>assistant` if asked for."""
    out = [s for m in messages for s in message_segments(m)]
    return out + [START, "assistant"] if add_generation_prompt else out


def encode_segments(segments: Sequence[Segment], encode_text: Callable[[str], list[int]],
                    ids: HarmonyIds) -> list[int]:
    """Token ids of `segments`: specials by id, each text piece encoded on its own."""
    by_name = ids.by_name
    out: list[int] = []
    for segment in segments:
        if isinstance(segment, Special):
            out.append(by_name[segment.name])
        elif segment:
            out += encode_text(segment)
    return out


class LoomRenderer:
    """Renders with a Loom tokenizer. Its text encoder is a private copy of the tokenizer's
    backend that encodes special tokens' spellings as ordinary text (the model's own
    tokenizer would turn a user's literal "<|start|>" into the special token)."""

    def __init__(self, tokenizer: Tokenizer, ids: HarmonyIds) -> None:
        backend = HFTokenizer.from_str(tokenizer.backend.to_str())
        backend.encode_special_tokens = True
        self._backend = backend
        self._ids = ids

    def encode_text(self, text: str) -> list[int]:
        """`text` as ordinary text (no special tokens)."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def render(self, messages: Sequence[HarmonyMessage], add_generation_prompt: bool) -> list[int]:
        """Token ids of `messages` (as given: no message is dropped here)."""
        return encode_segments(conversation_segments(messages, add_generation_prompt),
                               self.encode_text, self._ids)
