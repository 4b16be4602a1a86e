"""`HarmonyCodec`: the harmony format for one model's tokenizer: conversations rendered to
token ids, outputs parsed by channel, through one of two backends:

- "openai-harmony": the package itself, whenever it can serve the tokenizer (gpt-oss's
  o200k vocabulary, `package.py`);
- "loom": Loom's own renderer and parser (`render.py`, `parser.py`), for any other
  vocabulary that carries the harmony special tokens (tiny test models); they render and
  parse as the package does (proven on the o200k vocabulary by the tests).

Both drop stale analysis messages by the one rule (`conversation.drop_stale_analysis`).
Why the package was not used is logged once, when the codec is made (a warning where the
model looks like gpt-oss, whose vocabulary the package serves).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from loom.harmony.conversation import HarmonyMessage, drop_stale_analysis
from loom.harmony.events import Header
from loom.harmony.package import (
    O200K_HARMONY_SIZE,
    PACKAGE_IDS,
    PackageUnavailable,
    load_package_backend,
)
from loom.harmony.parser import HarmonyParser, TokenReader
from loom.harmony.reader import LoomReader
from loom.harmony.render import LoomRenderer
from loom.harmony.tokens import HarmonyIds
from loom.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PACKAGE_BACKEND, LOOM_BACKEND = "openai-harmony", "loom"


class _Backend(Protocol):
    reader: TokenReader

    def render(self, messages: Sequence[HarmonyMessage],
               add_generation_prompt: bool) -> list[int]: ...


class _LoomBackend:
    """Loom's renderer and reader together."""

    def __init__(self, tokenizer: Tokenizer, ids: HarmonyIds) -> None:
        self._renderer = LoomRenderer(tokenizer, ids)
        self.reader = LoomReader(tokenizer, ids)
        self.render = self._renderer.render


class HarmonyCodec:
    """Renders conversations and parses outputs in the harmony format for one tokenizer."""

    def __init__(self, backend_name: str, backend: _Backend, ids: HarmonyIds,
                 fallback_reason: str | None = None) -> None:
        self.backend = backend_name
        self.ids = ids
        self.fallback_reason = fallback_reason  # why the package is not used, if it is not
        self._backend = backend

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, use_package: bool = True) -> HarmonyCodec | None:
        """The codec for `tokenizer`; None when its vocabulary lacks a harmony special
        token. The package's backend when it can serve (and `use_package`), else Loom's,
        with the reason logged."""
        ids = HarmonyIds.lookup(tokenizer.token_to_id)
        if ids is None:
            return None
        reason = "the package was not asked for"
        if use_package:
            try:
                return cls(PACKAGE_BACKEND, load_package_backend(tokenizer, ids), ids)
            except PackageUnavailable as e:
                reason = str(e)
                # Worth a warning where the model looks like gpt-oss (its vocabulary's size
                # and special ids are o200k_harmony's): there the package was expected.
                gpt_oss = ids == PACKAGE_IDS and tokenizer.vocab_size >= O200K_HARMONY_SIZE
                logger.log(logging.WARNING if gpt_oss else logging.INFO,
                           "harmony format: Loom renders and parses it, not openai-harmony: %s",
                           reason)
        return cls(LOOM_BACKEND, _LoomBackend(tokenizer, ids), ids, reason)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokens that end an assistant's turn: `<|return|>`, `<|call|>`."""
        return self.ids.stop_ids

    @property
    def special_ids(self) -> dict[str, int]:
        """Each harmony special token's spelling -> its id."""
        return self.ids.by_name

    def render(self, messages: list[HarmonyMessage], add_generation_prompt: bool = True
               ) -> list[int]:
        """Token ids of `messages` (stale analysis dropped), ending in `<|start|>assistant`
        with `add_generation_prompt`."""
        return self._backend.render(drop_stale_analysis(messages), add_generation_prompt)

    def parser(self, start: Header | None = None) -> HarmonyParser:
        """A parser of one output that follows the generation prompt; `start`: the header
        of the message the prompt opened, when it ends inside one (after `<|message|>`)."""
        return HarmonyParser(self._backend.reader, start)

    def __repr__(self) -> str:
        return f"HarmonyCodec(backend={self.backend!r})"
