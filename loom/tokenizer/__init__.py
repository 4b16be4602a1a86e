"""Tokenizers: loading (HF folders, GGUF metadata, cached), chat templates, incremental
detokenising, stops."""

from loom.tokenizer.chat_template import ChatTemplate, ChatTemplateError
from loom.tokenizer.detokenizer import IncrementalDetokenizer
from loom.tokenizer.loader import default_cache_dir, load_tokenizer
from loom.tokenizer.stop_strings import StopMatch, StopStringChecker
from loom.tokenizer.tokenizer import Tokenizer, TokenizerConfig

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "StopMatch",
    "StopStringChecker",
    "Tokenizer",
    "TokenizerConfig",
    "default_cache_dir",
    "load_tokenizer",
]
