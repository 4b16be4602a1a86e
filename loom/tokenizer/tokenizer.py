"""`Tokenizer`: a HF `tokenizers.Tokenizer` plus the model's special-token facts (BOS, EOS, ...)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from tokenizers import Tokenizer as HFTokenizer


@dataclass(frozen=True)
class TokenizerConfig:
    """What the backend tokenizer does not know: special ids, BOS/EOS policy, chat template.

    `eos_token_ids` is the full set that ends generation; it holds `eos_token_id` plus only
    the ids the model's files name explicitly (generation_config.json, GGUF eot/eom ids).
    """

    bos_token_id: int | None = None
    eos_token_id: int | None = None
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    pad_token_id: int | None = None
    unk_token_id: int | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    chat_template: str | None = None

    def to_json(self) -> str:
        """Serialise (for the on-disk tokenizer cache)."""
        data = asdict(self)
        data["eos_token_ids"] = sorted(self.eos_token_ids)
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> TokenizerConfig:
        """Inverse of `to_json`."""
        data = json.loads(text)
        data["eos_token_ids"] = frozenset(data["eos_token_ids"])
        return cls(**data)


class Tokenizer:
    """Encode and decode text for one model; immutable after construction."""

    def __init__(self, backend: HFTokenizer, config: TokenizerConfig) -> None:
        self._backend = backend
        self._config = config
        eos = set(config.eos_token_ids)
        if config.eos_token_id is not None:
            eos.add(config.eos_token_id)
        self._eos_token_ids = frozenset(eos)
        self._special_ids = sorted(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )

    @property
    def backend(self) -> HFTokenizer:
        """The wrapped `tokenizers.Tokenizer` (no post-processor: BOS/EOS are added here)."""
        return self._backend

    @property
    def config(self) -> TokenizerConfig:
        """The special-token facts this tokenizer was built with."""
        return self._config

    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token, if the model has one."""
        return self._config.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """Id of the primary end-of-sequence token."""
        return self._config.eos_token_id

    @property
    def eos_token_ids(self) -> set[int]:
        """Every token id that ends generation (a fresh set; mutate freely)."""
        return set(self._eos_token_ids)

    @property
    def pad_token_id(self) -> int | None:
        """Id of the padding token, if any."""
        return self._config.pad_token_id

    @property
    def add_bos_token(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` prepends BOS."""
        return self._config.add_bos_token and self._config.bos_token_id is not None

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of every token marked special (those `skip_special_tokens` drops), sorted."""
        return list(self._special_ids)

    @property
    def chat_template(self) -> str | None:
        """The model's Jinja chat template, if its files carry one."""
        return self._config.chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS/EOS as the model's config says."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            return self._add_special(ids)
        return ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """`encode` over many texts (parallel in the backend)."""
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=False)
        if add_special_tokens:
            return [self._add_special(e.ids) for e in encodings]
        return [e.ids for e in encodings]

    def _add_special(self, ids: list[int]) -> list[int]:
        cfg = self._config
        if self.add_bos_token and cfg.bos_token_id is not None:
            ids = [cfg.bos_token_id, *ids]
        if cfg.add_eos_token and cfg.eos_token_id is not None:
            ids = [*ids, cfg.eos_token_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens dropped when `skip_special_tokens`."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """Vocabulary strings of `ids` (None for an id out of range)."""
        return [self._backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string, or None."""
        return self._backend.token_to_id(token)

    def __repr__(self) -> str:
        cfg = self._config
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={cfg.bos_token_id}, "
            f"eos={sorted(self._eos_token_ids)}, add_bos={cfg.add_bos_token})"
        )
