"""The openai-harmony package as a harmony backend: its encoding loaded offline from the
vocabulary the model carries, its renderer, and its parser's reading of headers.

The package reads o200k's vocabulary file from the directory named by the environment
variable TIKTOKEN_ENCODINGS_BASE when it loads an encoding (else it downloads it). Loom
writes the file from the model's tokenizer (`vocab.py`) under its cache directory, and sets
the variable only while the package loads (under a lock; the previous value is restored).
The package can serve a model whose tokenizer has o200k's 201088 ids, the harmony special
tokens at o200k_harmony's ids and o200k's ordinary tokens; `load_package_backend` says why
not otherwise. The package is imported only when a codec asks for it (it is optional).
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from loom.cache_dir import loom_cache_dir
from loom.harmony.conversation import HarmonyMessage
from loom.harmony.events import Header
from loom.harmony.tokens import HarmonyIds
from loom.harmony.vocab import VocabularyMismatch, write_o200k_file
from loom.tokenizer.tokenizer import Tokenizer

ENCODINGS_BASE_VAR = "TIKTOKEN_ENCODINGS_BASE"
O200K_HARMONY_SIZE = 201088  # ids 0..201087
# The harmony special tokens' ids in o200k_harmony (the package's encoding).
PACKAGE_IDS = HarmonyIds(start=200006, end=200007, message=200008, channel=200005,
                         return_=200002, call=200012, constrain=200003)
_ENV_LOCK = threading.Lock()


class PackageUnavailable(Exception):
    """The package cannot serve this tokenizer (the message says why)."""


def _package() -> ModuleType:
    """The openai_harmony module (ImportError when it is not installed)."""
    return importlib.import_module("openai_harmony")


def load_encoding(directory: str) -> Any:
    """The package's gpt-oss encoding, its vocabulary file read from `directory`."""
    h = _package()
    with _ENV_LOCK:
        before = os.environ.get(ENCODINGS_BASE_VAR)
        os.environ[ENCODINGS_BASE_VAR] = directory
        try:
            return h.load_harmony_encoding(h.HarmonyEncodingName.HARMONY_GPT_OSS)
        finally:
            if before is None:
                del os.environ[ENCODINGS_BASE_VAR]
            else:
                os.environ[ENCODINGS_BASE_VAR] = before


class PackageReader:
    """A `parser.TokenReader` over the package: token bytes from its vocabulary, headers
    read by its own parser (a fresh one per header)."""

    def __init__(self, encoding: Any) -> None:
        self._encoding = encoding
        self._h = _package()
        self._errors = (self._h.HarmonyError, ValueError)

    @property
    def ids(self) -> HarmonyIds:
        """o200k_harmony's special token ids."""
        return PACKAGE_IDS

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` stands for (b"" outside the vocabulary)."""
        try:
            text = self._encoding.decode([token_id], errors="surrogateescape")
        except self._errors:
            return b""
        return text.encode("utf-8", errors="surrogateescape")

    def header(self, token_ids: Sequence[int], role_known: bool) -> Header | None:
        """The header's fields as the package's parser reads them; None when it refuses."""
        h = self._h
        parser = h.StreamableParser(self._encoding, h.Role.ASSISTANT if role_known else None)
        try:
            if not role_known:
                parser.process(PACKAGE_IDS.start)
            for token in token_ids:
                parser.process(token)
            parser.process(PACKAGE_IDS.message)
        except self._errors:
            return None
        return Header(parser.current_channel, parser.current_recipient,
                      parser.current_content_type)


class PackageBackend:
    """Rendering and parsing by the package's gpt-oss encoding."""

    def __init__(self, encoding: Any) -> None:
        self._encoding = encoding
        self._h = _package()
        self.reader = PackageReader(encoding)

    def render(self, messages: Sequence[HarmonyMessage], add_generation_prompt: bool) -> list[int]:
        """Token ids of `messages` as the package renders them (none dropped here)."""
        h = self._h
        conversation = h.Conversation.from_messages([
            h.Message(author=h.Author(role=h.Role(m.role), name=m.author_name),
                      content=[h.TextContent(text=m.content)], channel=m.channel,
                      recipient=m.recipient, content_type=m.content_type)
            for m in messages])
        config = h.RenderConversationConfig(auto_drop_analysis=False)
        if add_generation_prompt:
            return self._encoding.render_conversation_for_completion(
                conversation, h.Role.ASSISTANT, config)
        return self._encoding.render_conversation(conversation, config)


def load_package_backend(tokenizer: Tokenizer, ids: HarmonyIds) -> PackageBackend:
    """The package's backend for `tokenizer` (whose harmony ids are `ids`), its vocabulary
    file written under `loom_cache_dir("harmony")`; PackageUnavailable says why not."""
    if tokenizer.vocab_size < O200K_HARMONY_SIZE:
        raise PackageUnavailable(f"the vocabulary has {tokenizer.vocab_size} ids, "
                                 f"o200k_harmony's {O200K_HARMONY_SIZE}")
    if ids != PACKAGE_IDS:
        raise PackageUnavailable("the harmony special tokens are not at o200k_harmony's ids")
    try:
        _package()
    except ImportError as e:
        raise PackageUnavailable(f"openai-harmony is not importable ({e})") from e
    try:
        path = write_o200k_file(tokenizer, loom_cache_dir("harmony"))
    except VocabularyMismatch as e:
        raise PackageUnavailable(f"the vocabulary is not o200k: {e}") from e
    except OSError as e:
        raise PackageUnavailable(f"cannot write the o200k vocabulary file: {e}") from e
    try:
        encoding = load_encoding(str(path.parent))
    except Exception as e:  # the package's loading errors share no class
        raise PackageUnavailable(f"openai-harmony cannot load o200k_harmony: {e}") from e
    return PackageBackend(encoding)
