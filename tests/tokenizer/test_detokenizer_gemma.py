"""Incremental detokenising on Gemma's vocabulary: byte fallback, emoji, spacing, appends."""

from __future__ import annotations

import random

import pytest

from loom.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.slow

_CHARS = [*"aé中😀👍🏽🇫🇷𓀀ꙮ𝔘 \n\t", "  ", "\n\n"]


def _byte_ids(tok: Tokenizer, text: str) -> list[int]:
    """`text` spelled as byte-fallback tokens `<0xNN>`."""
    ids = [tok.token_to_id(f"<0x{b:02X}>") for b in text.encode("utf-8")]
    assert None not in ids
    return ids  # type: ignore[return-value]


def _normal_ids(tok: Tokenizer, rng: random.Random, n: int) -> list[int]:
    special = set(tok.all_special_ids)
    out: list[int] = []
    while len(out) < n:
        i = rng.randrange(tok.vocab_size)
        if i not in special and "\ufffd" not in tok.decode([i]):
            out.append(i)
    return out


def _random_sequence(tok: Tokenizer, rng: random.Random, length: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < length:
        r = rng.random()
        if r < 0.4:
            ids += _byte_ids(tok, rng.choice(_CHARS))
        elif r < 0.5:
            ids.append(rng.choice([*tok.all_special_ids[:8], 105, 106]))
        else:
            ids += _normal_ids(tok, rng, 1)
    return ids


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add([i]) for i in ids]


@pytest.mark.parametrize("skip", [True, False])
def test_random_sequences_equal_full_decode(gemma_tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(1234)
    for _ in range(40):
        prompt = gemma_tok.encode("Tell me a story.")
        ids = _random_sequence(gemma_tok, rng, rng.randint(1, 60))
        detok = IncrementalDetokenizer(gemma_tok, prompt, skip_special_tokens=skip)
        deltas = _stream(detok, ids)
        expected = gemma_tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == expected
        assert detok.text == expected
        assert not any("\ufffd" in d for d in deltas)
        assert not detok.has_pending


def test_encoded_text_streams_back_exactly(gemma_tok: Tokenizer) -> None:
    texts = [
        " Hello  world,\n\tthis is   spaced.",
        "emoji 😀🎉👍🏽 family 👨‍👩‍👧 flag 🇫🇷 and 𓀀𓀁 ꙮ",
        "日本語のテキスト\n\ncode:\n    x = 1\n",
    ]
    for text in texts:
        ids = gemma_tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(gemma_tok, gemma_tok.encode("Q:"))
        deltas = _stream(detok, ids)
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_is_held_until_complete(gemma_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(gemma_tok, [2])
    first, *rest = _byte_ids(gemma_tok, "😀")
    assert detok.add([first]) == ""
    assert detok.has_pending
    assert [detok.add([i]) for i in rest] == ["", "", "😀"]
    assert detok.text == "😀"


def test_invalid_bytes_are_emitted_after_a_bounded_wait(gemma_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(gemma_tok, [2])
    lone = _byte_ids(gemma_tok, "😀")[0]  # a lead byte that never gets its continuation
    assert detok.add([lone]) == ""
    assert detok.flush() == "\ufffd"
    detok = IncrementalDetokenizer(gemma_tok, [2])
    out = [detok.add([lone]) for _ in range(5)]
    assert "".join(out).count("\ufffd") >= 4  # never held forever


def test_append_prompt_interleaved(gemma_tok: Tokenizer) -> None:
    rng = random.Random(7)
    prompt = gemma_tok.encode("<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")
    detok = IncrementalDetokenizer(gemma_tok, prompt)
    fed: list[int] = []
    for step in range(10):
        if step % 3 == 2:
            frag = gemma_tok.encode(f" fragment {step} 😀 ", add_special_tokens=False)
            detok.append_prompt(frag)
            fed += frag
        else:
            ids = _random_sequence(gemma_tok, rng, 8)
            _stream(detok, ids)
            fed += ids
    assert detok.text == gemma_tok.decode(fed)
    assert detok.token_ids == fed
    assert detok.num_tokens == len(fed)


class _CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call gets."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_window_stays_small(gemma_tok: Tokenizer) -> None:
    counting = _CountingTokenizer(gemma_tok)
    prompt = gemma_tok.encode("x " * 1000)
    detok = IncrementalDetokenizer(counting, prompt)  # type: ignore[arg-type]
    ids = _random_sequence(gemma_tok, random.Random(3), 2000)
    _stream(detok, ids)
    assert max(counting.sizes) <= 12  # held bytes (<= 4) + a prefix window (<= 4 bytes + 4)
    assert len(counting.sizes) <= 2 * len(ids)
