"""Which backend `HarmonyCodec.for_tokenizer` picks, and why it falls back."""

from __future__ import annotations

import logging
import sys

import pytest

from loom.harmony import HarmonyCodec
from loom.harmony.package import PACKAGE_IDS, PackageUnavailable, load_package_backend
from loom.harmony.tokens import HarmonyIds
from loom.harmony.vocab import O200K_ORDINARY, VocabularyMismatch, o200k_file_bytes


def test_none_without_the_harmony_tokens(plain_tokenizer):
    assert HarmonyCodec.for_tokenizer(plain_tokenizer) is None


def test_a_small_vocabulary_falls_back_to_loom_with_the_reason_logged(
        tiny_tokenizer, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="loom.harmony"):
        codec = HarmonyCodec.for_tokenizer(tiny_tokenizer)
    assert codec is not None and codec.backend == "loom"
    assert "409 ids" in codec.fallback_reason
    assert [r.getMessage() for r in caplog.records if codec.fallback_reason in r.getMessage()]
    assert not (tmp_path / "harmony").exists()


def test_codec_ids(tiny_codec, tiny_tokenizer):
    ids = {name: tiny_tokenizer.token_to_id(name) for name in tiny_codec.special_ids}
    assert tiny_codec.special_ids == ids
    assert tiny_codec.stop_token_ids == (ids["<|return|>"], ids["<|call|>"])


class _BigVocabulary:
    """A tokenizer-like object with o200k_harmony's size (nothing else is read first)."""

    vocab_size = 201088


def test_package_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "openai_harmony", None)
    with pytest.raises(PackageUnavailable, match="not importable"):
        load_package_backend(_BigVocabulary(), PACKAGE_IDS)


def test_special_tokens_elsewhere_than_o200k_harmony(tiny_tokenizer):
    ids = HarmonyIds.lookup(tiny_tokenizer.token_to_id)
    with pytest.raises(PackageUnavailable, match="not at o200k_harmony's ids"):
        load_package_backend(_BigVocabulary(), ids)


class _FakeVocabulary:
    """A tokenizer-like vocabulary of byte-level tokens that is not o200k's."""

    def convert_ids_to_tokens(self, ids):
        return [f"t{i}" for i in ids]


def test_a_vocabulary_that_is_not_o200k_is_refused():
    with pytest.raises(VocabularyMismatch, match="not o200k_base's"):
        o200k_file_bytes(_FakeVocabulary())


def test_a_vocabulary_that_is_not_byte_level_is_refused():
    class SentencePiece(_FakeVocabulary):
        def convert_ids_to_tokens(self, ids):
            return ["\u2581word"] * len(ids)

    with pytest.raises(VocabularyMismatch, match=r"token 0 .* not a byte-level token"):
        o200k_file_bytes(SentencePiece())
    assert O200K_ORDINARY == 199998
