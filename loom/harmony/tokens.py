"""The harmony format's special tokens in a model's vocabulary, and the bytes a token stands
for (what a parser decodes and the o200k vocabulary file is written from)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from tokenizers import decoders

from loom.tokenizer.gguf_tokenizer import byte_alphabet
from loom.tokenizer.tokenizer import Tokenizer

# The special tokens the format cannot do without (a vocabulary lacking one is not harmony's).
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
                  "<|call|>", "<|constrain|>")


@dataclass(frozen=True)
class HarmonyIds:
    """The ids of HARMONY_TOKENS in one vocabulary."""

    start: int
    end: int
    message: int
    channel: int
    return_: int
    call: int
    constrain: int

    @classmethod
    def lookup(cls, token_to_id: Callable[[str], int | None]) -> HarmonyIds | None:
        """The ids `token_to_id` gives HARMONY_TOKENS; None when it lacks any of them."""
        ids = [token_to_id(name) for name in HARMONY_TOKENS]
        if any(i is None for i in ids):
            return None
        start, end, message, channel, return_, call, constrain = (int(i) for i in ids)
        return cls(start, end, message, channel, return_, call, constrain)

    @property
    def by_name(self) -> dict[str, int]:
        """Token string -> id, for each of HARMONY_TOKENS."""
        return dict(zip(HARMONY_TOKENS, (self.start, self.end, self.message, self.channel,
                                         self.return_, self.call, self.constrain), strict=True))

    @property
    def stop_ids(self) -> tuple[int, int]:
        """The tokens that end an assistant's turn: `<|return|>` (done), `<|call|>`."""
        return (self.return_, self.call)

    @property
    def end_kinds(self) -> dict[int, str]:
        """Each token that ends a message -> how it ended ("end", "call", "return")."""
        return {self.end: "end", self.call: "call", self.return_: "return"}


@cache
def inverse_byte_alphabet() -> dict[str, int]:
    """GPT-2's printable character -> the byte it spells (inverse of `byte_alphabet`)."""
    return {char: byte for byte, char in byte_alphabet().items()}


def byte_level_bytes(token: str) -> bytes | None:
    """The bytes a byte-level token spells in GPT-2's alphabet; None when a character of it
    is not in that alphabet."""
    inverse = inverse_byte_alphabet()
    if not all(c in inverse for c in token):
        return None
    return bytes(inverse[c] for c in token)


class TokenBytes:
    """The bytes each token id of a Loom tokenizer stands for: an added (special) token's
    text, a byte-level token's bytes; for a vocabulary that is not byte-level, the token's
    decoded text (exact for whole characters only). An id outside the vocabulary is b""."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._added = {i: t.content for i, t in
                       tokenizer.backend.get_added_tokens_decoder().items()}
        self._byte_level = isinstance(tokenizer.backend.decoder, decoders.ByteLevel)

    def __call__(self, token_id: int) -> bytes:
        """The bytes of `token_id`."""
        added = self._added.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        token = self._tokenizer.convert_ids_to_tokens([token_id])[0]
        if token is None:
            return b""
        spelled = byte_level_bytes(token) if self._byte_level else None
        if spelled is not None:
            return spelled
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
