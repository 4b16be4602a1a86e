"""Loom's tokenizer built from the Gemma 3 GGUF == transformers' tokenizer of the same file."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from loom.tokenizer import Tokenizer, load_tokenizer

pytestmark = pytest.mark.slow

SAMPLES = [
    "Hello world",
    "Hello, world! How are you?",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "a  b   c    d     e",
    "\n\nnew\n\n\nlines\n",
    "\ttab\t\tand\t\t\ttabs",
    "mixed \t \n whitespace \r\n windows",
    "def square(x):\n    return x ** 2  # comment\n\n\nclass A:\n\tpass\n",
    'for (int i = 0; i < n; ++i) { sum += a[i]; }  // C\nprint("done")',
    "café naïve résumé façade déjà vu Ñandú",
    "日本語のテキストと中文文本，한국어 텍스트",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "digits 0 12 345 6789 3.14159 -42 1e10 1,000,000",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "html <b>bold</b> <table><tr><td>x</td></tr></table>",
    "rare script 𓀀𓀁 ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 مرحبا שלום",
    " ",
    "",
]

_PIECES = [
    *"abcXYZ 019\n\t.,;:!?'\"()[]{}<>-_/\\|@#$%^&*~`",
    *"éüñßçøå中文日本한국어😀🎉👍🏽🚀∑∞≈€",
    "  ",
    "   ",
    "\n\n",
    "\t\t",
    " the",
    " and",
    "ing",
    "<b>",
    "<start_of_turn>",
    "<eos>",
]


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 30))) for _ in range(n)]


def test_ids_match_transformers(gemma_tok: Tokenizer, gemma_hf_tokenizer) -> None:
    for text in SAMPLES + _random_texts(300):
        assert gemma_tok.encode(text) == gemma_hf_tokenizer.encode(text), repr(text)
        assert gemma_tok.encode(text, add_special_tokens=False) == gemma_hf_tokenizer.encode(
            text, add_special_tokens=False
        ), repr(text)


def test_decode_matches_transformers(gemma_tok: Tokenizer, gemma_hf_tokenizer) -> None:
    for text in SAMPLES:
        ids = gemma_tok.encode(text)
        for skip in (True, False):
            assert gemma_tok.decode(ids, skip_special_tokens=skip) == gemma_hf_tokenizer.decode(
                ids, skip_special_tokens=skip
            )


def test_round_trip(gemma_tok: Tokenizer) -> None:
    for text in SAMPLES + _random_texts(100, seed=1):
        ids = gemma_tok.encode(text, add_special_tokens=False)
        assert gemma_tok.decode(ids, skip_special_tokens=False) == text


def test_special_tokens(gemma_tok: Tokenizer) -> None:
    assert gemma_tok.bos_token_id == 2
    assert gemma_tok.eos_token_id == 1
    assert gemma_tok.eos_token_ids == {1}  # the GGUF names no end-of-turn id
    assert gemma_tok.pad_token_id == 0
    assert gemma_tok.vocab_size == 262144
    assert gemma_tok.encode("hi")[0] == 2
    assert gemma_tok.convert_ids_to_tokens([2, 105, 106, 107]) == [
        "<bos>",
        "<start_of_turn>",
        "<end_of_turn>",
        "\n",
    ]
    special = set(gemma_tok.all_special_ids)
    assert {0, 1, 2, 105, 106} <= special and 107 not in special
    # special tokens are matched whole and dropped by decode(skip_special_tokens=True)
    ids = gemma_tok.encode("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False)
    assert ids[0] == 105 and ids[-1] == 106
    assert gemma_tok.decode(ids) == "user\nhi"


def test_cache_hit_is_fast_and_identical(
    gemma_path: Path, gemma_cache_dir: Path, gemma_tok_and_time: tuple[Tokenizer, float]
) -> None:
    cold_tok, cold_s = gemma_tok_and_time
    start = time.perf_counter()
    warm_tok = load_tokenizer(gemma_path, cache_dir=gemma_cache_dir)
    warm_s = time.perf_counter() - start
    assert list(gemma_cache_dir.glob("*.meta.json")), "conversion was not cached"
    # Relative as well as absolute, so a busy machine does not make this flaky.
    assert warm_s < 2.0 or warm_s < 0.75 * cold_s, f"cache hit {warm_s:.2f}s, cold {cold_s:.2f}s"
    assert warm_tok.config == cold_tok.config
    for text in SAMPLES:
        assert warm_tok.encode(text) == cold_tok.encode(text)
