"""Build a `tokenizers.Tokenizer` from GGUF metadata (`tokenizer.ggml.*`), as transformers does.

Two vocabulary kinds exist in GGUF files:

- `tokenizer.ggml.model == "llama"`: SentencePiece BPE (Llama 2, Gemma). The file lists tokens
  and scores but no merges, so merges are derived: every way to cut a token into two tokens
  that are both in the vocabulary is a merge, ranked by the token's score (Gemma: by the
  token's position in the file, since its scores do not follow the merge order).
- `"gpt2"`: byte-level BPE (Llama 3, Qwen). Tokens are spelled in GPT-2's byte alphabet and
  the merges are in the file; the split regex is picked by `tokenizer.ggml.pre`.

Token types (`tokenizer.ggml.token_type`): 3 = control (added as special tokens, matched whole),
4 = user-defined (added as plain tokens, matched whole), 6 = byte (`<0x0A>`, byte fallback).
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from loom.errors import UnsupportedModelError
from loom.tokenizer.tokenizer import TokenizerConfig

_CONTROL, _USER_DEFINED = 3, 4
_SPM_SPACE = "\u2581"  # "▁": SentencePiece's visible space
# Architectures whose "llama" vocabulary follows Gemma's conventions (see `_sentencepiece`).
_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3", "gemma3n"})

# Split regexes of byte-level BPE vocabularies, keyed by `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k's (gpt-oss, llama.cpp's "gpt-4o"): a word is an upper-case run then a lower-case
# run (or the other way), with its contraction; digits in threes; punctuation keeps a
# trailing newline or slash.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "gpt-4o": _GPT4O_SPLIT,
}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map used to spell byte-level BPE tokens."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def derive_merges(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary: best `rank` first, then the longer left piece first.

    Ties (equal rank and piece lengths) keep `rank`'s iteration order.
    """
    entries: list[tuple[float, int, int, str, str]] = []
    for token, score in rank.items():
        n = len(token)
        for cut in range(1, n):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                entries.append((score, cut, n - cut, left, right))
    entries.sort(key=lambda e: (e[0], e[1], e[2]), reverse=True)  # stable for ties
    return [(e[3], e[4]) for e in entries]


def _token_name(tokens: list[str], token_id: Any) -> str | None:
    if isinstance(token_id, int) and 0 <= token_id < len(tokens):
        return tokens[token_id]
    return None


def _sentencepiece(meta: dict[str, Any], tokens: list[str]) -> tuple[HFTokenizer, list[str]]:
    """SentencePiece-BPE; returns the backend and the vocabulary as the backend spells it."""
    gemma = meta.get("general.architecture") in _GEMMA_ARCHS
    if gemma:
        # Gemma files store runs of spaces as real spaces; the model matches them as "▁▁...".
        spelled = [_SPM_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        rank: dict[str, float] = {t: -float(i) for i, t in enumerate(spelled)}
    else:
        spelled = list(tokens)
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        rank = dict(zip(spelled, scores, strict=True))
    vocab = {t: i for i, t in enumerate(spelled)}
    unk = _token_name(spelled, meta.get("tokenizer.ggml.unknown_token_id"))
    model = BPE(
        vocab=vocab,
        merges=derive_merges(vocab, rank),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
        dropout=None,
    )
    backend = HFTokenizer(model)
    decode_steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", _SPM_SPACE)
    else:
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPM_SPACE, prepend_scheme="first" if prefix else "never", split=False
        )
        if prefix:
            decode_steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(decode_steps)
    return backend, spelled


def _byte_level(meta: dict[str, Any], tokens: list[str]) -> tuple[HFTokenizer, list[str]]:
    """Byte-level BPE with the file's merges; returns the backend and its token spellings."""
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    spelled = [
        t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens
    ]
    merges = []
    for line in meta.get("tokenizer.ggml.merges") or []:
        parts = line.split(" ")
        if len(parts) != 2:
            raise UnsupportedModelError(f"GGUF merge {line!r} is not two tokens")
        merges.append((parts[0], parts[1]))
    vocab = {t: i for i, t in enumerate(spelled)}
    backend = HFTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, dropout=None))
    split = _SPLIT_BY_PRE.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend, spelled


def _add_whole_tokens(
    backend: HFTokenizer, meta: dict[str, Any], tokens: list[str], spelled: list[str]
) -> None:
    """Register control and user-defined tokens so they are matched whole, never split."""
    types = meta.get("tokenizer.ggml.token_type") or []
    in_vocab = set(spelled)
    named = {
        meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "unknown", "padding")
    }
    special: list[AddedToken] = []
    plain: list[AddedToken] = []
    for i, (token, kind) in enumerate(zip(tokens, types, strict=False)):
        # A token whose file spelling is not in the vocabulary would get a new id: skip it.
        if token not in in_vocab:
            continue
        if kind == _CONTROL or i in named:
            special.append(AddedToken(token, normalized=False, special=True))
        elif kind == _USER_DEFINED:
            plain.append(AddedToken(token, normalized=False, special=False))
    backend.add_special_tokens(special)
    backend.add_tokens(plain)


def tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> tuple[HFTokenizer, TokenizerConfig]:
    """The backend tokenizer and special-token config a GGUF file's metadata describes."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise UnsupportedModelError("GGUF file has no tokenizer.ggml.tokens")
    if kind == "llama":
        backend, spelled = _sentencepiece(meta, tokens)
    elif kind == "gpt2":
        backend, spelled = _byte_level(meta, tokens)
    else:
        raise UnsupportedModelError(
            f"GGUF tokenizer.ggml.model={kind!r} is not supported (supported: 'llama', 'gpt2')"
        )
    _add_whole_tokens(backend, meta, tokens, spelled)

    def token_id(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return value if isinstance(value, int) and 0 <= value < len(tokens) else None

    eos = token_id("eos_token_id")
    # End-of-turn / end-of-message ids are what llama.cpp stops on besides EOS.
    stop_ids = {
        i for i in (eos, token_id("eot_token_id"), token_id("eom_token_id")) if i is not None
    }
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    config = TokenizerConfig(
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=eos,
        eos_token_ids=frozenset(stop_ids),
        pad_token_id=token_id("padding_token_id"),
        unk_token_id=token_id("unknown_token_id"),
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        add_bos_token=bool(add_bos) if add_bos is not None else kind == "llama",
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
    )
    return backend, config
