"""Loom's own `TokenReader`: token bytes and header fields read with the model's Loom
tokenizer (any vocabulary that carries the harmony special tokens)."""

from __future__ import annotations

from collections.abc import Sequence

from loom.harmony.events import Header
from loom.harmony.header import parse_header_text
from loom.harmony.tokens import HarmonyIds, TokenBytes
from loom.tokenizer.tokenizer import Tokenizer


class LoomReader:
    """A `parser.TokenReader` over a Loom tokenizer."""

    def __init__(self, tokenizer: Tokenizer, ids: HarmonyIds) -> None:
        self._bytes = TokenBytes(tokenizer)
        self._ids = ids

    @property
    def ids(self) -> HarmonyIds:
        """The vocabulary's harmony special token ids."""
        return self._ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` stands for."""
        return self._bytes(token_id)

    def header(self, token_ids: Sequence[int], role_known: bool) -> Header | None:
        """The header's fields (`header.py`); None when it is invalid, or not UTF-8."""
        try:
            text = b"".join(self._bytes(t) for t in token_ids).decode("utf-8")
        except UnicodeDecodeError:
            return None
        return parse_header_text(text, role_known)
