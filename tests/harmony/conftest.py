"""Fixtures for the harmony tests: a tiny byte-level BPE tokenizer that carries the harmony
special tokens (as a tiny gpt-oss test model's does), and one that does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loom.harmony import HarmonyCodec
from loom.tokenizer.loader import load_hf_tokenizer
from loom.tokenizer.tokenizer import Tokenizer

# o200k_harmony's named special tokens, in its id order (a tiny vocabulary lists them last).
HARMONY_SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>",
                    "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>")

_CORPUS = [
    "The assistant answers the user. It thinks on the analysis channel, then writes the "
    "final answer; a call to a function goes on the commentary channel as JSON.",
    '{"location": "Tokyo", "unit": "celsius", "days": 3} {"temperature": 20, "sunny": true}',
    "type get_weather = (_: { location: string, unit?: \"c\" | \"f\", }) => any;",
    "Reasoning: low medium high. Knowledge cutoff: 2024-06. Current date: 2025-01-31.",
    "Crème brûlée à Paris, 東京の天気, emoji 🌦️ and ☃ snow.",
] * 8


def build_tokenizer(folder: Path, specials: tuple[str, ...]) -> Tokenizer:
    """A byte-level BPE trained on a small corpus, `specials` added as special tokens after
    its vocabulary, loaded as Loom loads a HF folder."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    tok.add_special_tokens(list(specials))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    eos = "<|return|>" if "<|return|>" in specials else "<pad>"
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": eos, "pad_token": "<pad>", "add_bos_token": False}))
    return load_hf_tokenizer(folder)


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The tiny harmony tokenizer."""
    return build_tokenizer(tmp_path_factory.mktemp("tiny-harmony"), HARMONY_SPECIALS)


@pytest.fixture(scope="session")
def plain_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The same vocabulary without the harmony special tokens."""
    return build_tokenizer(tmp_path_factory.mktemp("tiny-plain"), ("<|endoftext|>",))


@pytest.fixture(scope="session")
def tiny_codec(tiny_tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory
               ) -> HarmonyCodec:
    """The tiny tokenizer's codec (Loom's backend: the vocabulary is not o200k)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOOM_CACHE_DIR", str(tmp_path_factory.mktemp("loom-cache")))
        codec = HarmonyCodec.for_tokenizer(tiny_tokenizer)
    assert codec is not None
    return codec
