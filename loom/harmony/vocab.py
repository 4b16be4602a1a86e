"""The o200k vocabulary file the openai-harmony package loads (`o200k_base.tiktoken`),
written from the vocabulary a model carries, so that the package works offline.

The file lists the ordinary tokens, ids 0..199997, one line each in id order:
`base64(token bytes) SPACE id NEWLINE`. A model's tokenizer spells its byte-level tokens in
GPT-2's byte alphabet (`loom.tokenizer.gguf_tokenizer.byte_alphabet`); the file is built
from the bytes they spell, and only a vocabulary whose file has o200k's SHA-256 is written
(the package checks the hash again when it loads the file).
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

from loom.cache_dir import write_atomic
from loom.harmony.tokens import byte_level_bytes
from loom.tokenizer.tokenizer import Tokenizer

VOCAB_FILE = "o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_ORDINARY = 199998  # ids 0..199997 are ordinary tokens; the special ones follow


class VocabularyMismatch(Exception):
    """The tokenizer's vocabulary is not o200k's (the message says how it differs)."""


def o200k_file_bytes(tokenizer: Tokenizer) -> bytes:
    """The vocabulary file's content for `tokenizer`'s ordinary tokens; VocabularyMismatch
    when a token is missing, is not byte-level, or the content's hash is not o200k's."""
    tokens = tokenizer.convert_ids_to_tokens(range(O200K_ORDINARY))
    lines = []
    for token_id, token in enumerate(tokens):
        data = byte_level_bytes(token) if token is not None else None
        if data is None:
            raise VocabularyMismatch(f"token {token_id} ({token!r}) is not a byte-level token")
        lines.append(base64.b64encode(data) + b" " + str(token_id).encode() + b"\n")
    content = b"".join(lines)
    digest = hashlib.sha256(content).hexdigest()
    if digest != O200K_SHA256:
        raise VocabularyMismatch(f"its first {O200K_ORDINARY} tokens are not o200k_base's "
                                 f"(sha256 {digest[:12]}…, o200k's {O200K_SHA256[:12]}…)")
    return content


def write_o200k_file(tokenizer: Tokenizer, directory: Path) -> Path:
    """`directory/o200k_base.tiktoken` written from `tokenizer` (kept when the same file is
    there already; written whole or not at all). VocabularyMismatch when the
    vocabulary is not o200k's; OSError when the file cannot be written."""
    content = o200k_file_bytes(tokenizer)
    path = directory / VOCAB_FILE
    if path.is_file() and path.read_bytes() == content:
        return path
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(path, content)
    return path
