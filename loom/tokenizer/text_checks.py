"""What text a tokenizer can take: Python strings may hold what Unicode text cannot."""

from __future__ import annotations

import re

# A UTF-16 surrogate code point: what JSON's lone `\ud800` escapes parse to. No tokenizer
# takes text holding one (the HF tokenizers' TypeError), so callers refuse it first.
_SURROGATE = re.compile("[\ud800-\udfff]")
NOT_TEXT = "holds an unpaired UTF-16 surrogate, which is not Unicode text"


def has_unpaired_surrogate(text: str) -> bool:
    """Whether `text` holds a surrogate code point (never valid in Unicode text)."""
    return _SURROGATE.search(text) is not None
