"""Tiny GGUF files written here, one per vocabulary kind, against transformers' converter."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from packaging.version import Version
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from loom.errors import UnsupportedModelError
from loom.loader.gguf_reader import GGUFFile
from loom.tokenizer import load_tokenizer

gguf = pytest.importorskip("gguf")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. 1234567890 3.14",
    "def add(a, b):\n    return a + b\n\t# tabs and  double  spaces\n",
    "Café, naïve, déjà vu — 日本語 and emoji 😀🚀 in text. Don't we'll they're",
] * 30

_TEXTS = [
    "The fox jumps",
    " leading space and   runs   of spaces",
    "def f():\n\treturn 1\n\n\n",
    "naïve 日本 😀🚀 unseen 🦀 glyphs 12345678",
    "<|begin|>specials<|eot|> inside",
    "I'm sure they'll SAY it's 42.",
]

CONTROL, NORMAL, BYTE = 3, 1, 6


def _write(path: Path, tokens: list[str], types: list[int], **fields) -> Path:
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    for name, value in fields.items():
        getattr(writer, f"add_{name}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def _byte_level_gguf(path: Path) -> Path:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|begin|>", "<|end|>", "<|eot|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [CONTROL if t.startswith("<|") else NORMAL for t in tokens]
    return _write(
        path, tokens, types, tokenizer_model="gpt2", tokenizer_pre="llama-bpe",
        token_merges=merges, bos_token_id=0, eos_token_id=1, eot_token_id=2, add_bos_token=True,
    )  # fmt: skip


def _sentencepiece_gguf(path: Path) -> Path:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    vocab = json.loads(tok.to_str())["model"]["vocab"]
    pieces = sorted(vocab, key=vocab.get)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * len(pieces)]
    # Longer pieces were learnt later: score them lower, like SentencePiece does.
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return _write(
        path, tokens, types, tokenizer_model="llama", token_scores=scores, bos_token_id=1,
        eos_token_id=2, unk_token_id=0, add_space_prefix=True,
    )  # fmt: skip


# transformers builds a tokenizer from a GGUF of architecture "llama" with
# `transformers.integrations.gguf.get_gguf_tokenizer` from 5.18 on (checked: 5.18 to 5.23):
# 5.17 accepts only "qwen35" there, and 5.16 has no such module. The test extra pins >= 5.18.
_TRANSFORMERS_GGUF_TOKENIZER = Version("5.18")


def _transformers_backend(path: Path):
    transformers = pytest.importorskip("transformers")
    if Version(transformers.__version__) < _TRANSFORMERS_GGUF_TOKENIZER:
        pytest.skip(
            f"transformers {transformers.__version__} cannot convert a 'llama' GGUF tokenizer "
            f"(needs >= {_TRANSFORMERS_GGUF_TOKENIZER}: 5.17 accepts only 'qwen35', 5.16 has no "
            "transformers.integrations.gguf)"
        )
    from transformers.integrations import gguf as conv

    architecture, tokenizer_dict, _ = conv.get_gguf_tokenizer(str(path))
    backend, _ = conv.convert_gguf_tokenizer(architecture, tokenizer_dict)
    return backend


@pytest.mark.parametrize("build", [_byte_level_gguf, _sentencepiece_gguf])
def test_tiny_gguf_matches_transformers(build, tmp_path: Path) -> None:
    path = build(tmp_path / "tiny.gguf")
    tok = load_tokenizer(path, cache_dir=tmp_path / "cache")
    ref = _transformers_backend(path)
    for text in _TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False).ids, repr(text)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), repr(text)
    assert tok.encode("x")[0] == tok.bos_token_id


def test_byte_level_config(tmp_path: Path) -> None:
    tok = load_tokenizer(_byte_level_gguf(tmp_path / "bl.gguf"), cache_dir=tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert tok.eos_token_ids == {1, 2}  # the file names <|eot|> as end of turn
    assert tok.decode(tok.encode("naïve 😀", add_special_tokens=False)) == "naïve 😀"


def test_metadata_reader_matches_gguf_package(tmp_path: Path) -> None:
    path = _sentencepiece_gguf(tmp_path / "sp.gguf")
    ours = GGUFFile(path).all_metadata()
    reader = gguf.GGUFReader(str(path))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        theirs = field.contents()
        expected = pytest.approx(theirs) if isinstance(theirs, float) else theirs
        assert ours[key] == expected, key


def test_unsupported_vocabulary_kind(tmp_path: Path) -> None:
    path = _write(tmp_path / "t5.gguf", ["<pad>", "a"], [CONTROL, NORMAL], tokenizer_model="t5")
    with pytest.raises(UnsupportedModelError, match="t5"):
        load_tokenizer(path, cache_dir=tmp_path)


def test_cache_hit_and_corrupt_entry(tmp_path: Path) -> None:
    path = _byte_level_gguf(tmp_path / "bl.gguf")
    cache = tmp_path / "cache"
    cold = load_tokenizer(path, cache_dir=cache)
    (model_file,) = (p for p in cache.glob("*.json") if not p.name.endswith(".meta.json"))
    assert model_file.name.startswith("bl-")
    warm = load_tokenizer(path, cache_dir=cache)
    assert warm.config == cold.config
    model_file.write_text("{not json")  # a corrupt entry is rebuilt, not fatal
    rebuilt = load_tokenizer(path, cache_dir=cache)
    for text in _TEXTS:
        assert rebuilt.encode(text) == warm.encode(text) == cold.encode(text)
    assert not list(cache.glob("*.tmp"))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a changed file: new key
    load_tokenizer(path, cache_dir=cache)
    assert len(list(cache.glob("*.meta.json"))) == 2


def test_gpt4o_split_cuts_words_as_o200k_does() -> None:
    """gpt-oss's files name the "gpt-4o" pre-tokenizer: o200k's split (case runs, digits in
    threes, contractions kept on their word, a slash kept after punctuation)."""
    import regex

    from loom.tokenizer.gguf_tokenizer import _SPLIT_BY_PRE

    text = "Hello world's 12345 CamelCase HTTPServer\n\n  x a/b\n/ DON'T"
    assert regex.findall(_SPLIT_BY_PRE["gpt-4o"], text) == [
        "Hello", " world's", " ", "123", "45", " Camel", "Case", " HTTPServer", "\n\n", " ",
        " x", " a", "/b", "\n", "/", " DON'T"]
