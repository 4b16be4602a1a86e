"""A HF model folder (tokenizer.json + config files), with a tiny BPE tokenizer built here."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from loom.errors import ModelNotFoundError
from loom.tokenizer import (
    ChatTemplate,
    IncrementalDetokenizer,
    default_cache_dir,
    load_tokenizer,
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. 1234567890",
    "def add(a, b):\n    return a + b\n\t# tabs and  double  spaces\n",
    "Café, naïve, déjà vu — 日本語 and emoji 😀🚀 in text.",
] * 30

_TEXTS = [
    "The fox",
    "  two leading spaces",
    "def f():\n\treturn 1\n",
    "naïve 日本 😀🚀 unseen 🦀 glyphs",
    "<s>literal specials</s> in text",
    "",
]

_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def _build(folder: Path, config: dict | None, post_processor: bool = True) -> Path:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "</s>", "<s>", "<|eot|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A folder whose tokenizer_config.json says add_bos_token and carries a chat template."""
    folder = _build(
        tmp_path / "m",
        {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "add_bos_token": True,
            "chat_template": _TEMPLATE,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return folder


def test_special_ids_and_bos_once(folder: Path) -> None:
    tok = load_tokenizer(folder)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (2, 1, 0)
    assert tok.eos_token_ids == {1, 3}
    body = tok.encode("The fox", add_special_tokens=False)
    assert tok.encode("The fox") == [2, *body]  # the post-processor's BOS is not doubled
    assert sorted(tok.all_special_ids) == [0, 1, 2, 3]
    assert tok.vocab_size == HFTokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()


def test_ids_and_decode_match_transformers(folder: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = load_tokenizer(folder)
    for text in _TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), repr(text)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids)


def test_round_trip_and_streaming(folder: Path) -> None:
    tok = load_tokenizer(folder)
    for text in _TEXTS[:4]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        detok = IncrementalDetokenizer(tok, tok.encode("The"))
        deltas = [detok.add([i]) for i in ids]
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)  # byte-level pieces of emoji held back


def test_add_bos_detected_from_post_processor(tmp_path: Path) -> None:
    with_pp = load_tokenizer(_build(tmp_path / "a", {"bos_token": {"content": "<s>"}}))
    assert with_pp.add_bos_token and with_pp.encode("fox")[0] == 2
    without = load_tokenizer(_build(tmp_path / "b", {"bos_token": "<s>"}, post_processor=False))
    assert not without.add_bos_token and 2 not in without.encode("fox")
    no_config = load_tokenizer(_build(tmp_path / "c", None, post_processor=False))
    assert no_config.bos_token_id is None and no_config.eos_token_ids == set()


def test_chat_template(folder: Path) -> None:
    template = ChatTemplate.from_model(folder, folder)
    assert template is not None and template.template == _TEMPLATE
    messages = [{"role": "user", "content": "hi"}]
    assert template.render(messages) == "<s>[user] hi\n[assistant] "
    assert template.render(messages, add_generation_prompt=False) == "<s>[user] hi\n"
    tok = load_tokenizer(folder)  # the template writes BOS: the ids carry it once
    ids = template.render_ids(tok, messages)
    assert ids == [2, *tok.encode("[user] hi\n[assistant] ", add_special_tokens=False)]
    plain = _build(folder.parent / "plain", None)
    assert ChatTemplate.from_model(plain, plain) is None


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError):
        load_tokenizer(tmp_path)  # exists, but holds no tokenizer


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path / "tokenizers"
    monkeypatch.delenv("LOOM_CACHE_DIR")
    assert default_cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "loom" / "tokenizers"
