"""`load_tokenizer`: from a HF model folder or a `.gguf` file (converted once, cached on disk)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from loom.cache_dir import file_identity, loom_cache_dir, write_atomic
from loom.errors import ModelNotFoundError, UnsupportedModelError
from loom.tokenizer.tokenizer import Tokenizer, TokenizerConfig

# Bump when the GGUF conversion changes, so stale cache entries are not reused.
_CONVERTER_VERSION = "1"


def default_cache_dir() -> Path:
    """Where converted tokenizers are kept: `$LOOM_CACHE_DIR/tokenizers` or `~/.cache/loom/...`."""
    return loom_cache_dir("tokenizers")


def load_tokenizer(model_path: str | Path, cache_dir: Path | None = None) -> Tokenizer:
    """The tokenizer of a HF model folder, a `.gguf` file, or a folder holding one `.gguf`."""
    path = Path(model_path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"tokenizer path {path} does not exist")
    if path.is_file():
        if path.suffix == ".gguf":
            return load_gguf_tokenizer(path, cache_dir)
        if path.name == "tokenizer.json":
            return load_hf_tokenizer(path.parent)
        raise UnsupportedModelError(f"{path}: expected a .gguf file or a model folder")
    if (path / "tokenizer.json").is_file():
        return load_hf_tokenizer(path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return load_gguf_tokenizer(ggufs[0], cache_dir)
    raise ModelNotFoundError(
        f"{path}: no tokenizer.json and {len(ggufs)} .gguf files (need exactly one)"
    )


# ---------------------------------------------------------------- GGUF, with the disk cache


def _cache_key(path: Path) -> str:
    ident = f"{_CONVERTER_VERSION}|{file_identity(path)}"
    return f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def load_gguf_tokenizer(path: Path, cache_dir: Path | None = None) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes; reuses the on-disk conversion if fresh."""
    from loom.loader.gguf_reader import GGUFFile
    from loom.tokenizer.gguf_tokenizer import tokenizer_from_gguf_metadata

    cache = cache_dir if cache_dir is not None else default_cache_dir()
    key = _cache_key(path)
    model_file, meta_file = cache / f"{key}.json", cache / f"{key}.meta.json"
    if model_file.is_file() and meta_file.is_file():
        try:
            backend = HFTokenizer.from_file(str(model_file))
            config = TokenizerConfig.from_json(meta_file.read_text(encoding="utf-8"))
            return Tokenizer(backend, config)
        except Exception:  # a corrupt or foreign entry: rebuild it
            pass
    backend, config = tokenizer_from_gguf_metadata(GGUFFile(path).all_metadata())
    try:
        cache.mkdir(parents=True, exist_ok=True)
        # The model file first: a meta file is the mark of a complete entry.
        write_atomic(model_file, backend.to_str().encode("utf-8"))
        write_atomic(meta_file, config.to_json().encode("utf-8"))
    except OSError:
        pass  # a read-only cache only costs the next load its conversion time
    return Tokenizer(backend, config)


# ---------------------------------------------------------------- HF folders


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _chat_template(folder: Path, tok_cfg: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take "default", else the first
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str):
        return template
    chat_json = _read_json(folder / "chat_template.json").get("chat_template")
    return chat_json if isinstance(chat_json, str) else None


def _post_processor_adds(backend: HFTokenizer, token_id: int | None, first: bool) -> bool:
    """Whether the tokenizer.json post-processor puts `token_id` first (or last)."""
    if token_id is None:
        return False
    with_special = backend.encode("a", add_special_tokens=True).ids
    plain = backend.encode("a", add_special_tokens=False).ids
    if len(with_special) <= len(plain) or not with_special:
        return False
    return (with_special[0] if first else with_special[-1]) == token_id


def load_hf_tokenizer(folder: Path) -> Tokenizer:
    """A HF folder's `tokenizer.json`, with BOS/EOS from its config files."""
    folder = Path(folder)
    model_file = folder / "tokenizer.json"
    if not model_file.is_file():
        raise ModelNotFoundError(f"{folder}: no tokenizer.json")
    backend = HFTokenizer.from_file(str(model_file))
    tok_cfg = _read_json(folder / "tokenizer_config.json")
    special_map = _read_json(folder / "special_tokens_map.json")
    gen_cfg = _read_json(folder / "generation_config.json")
    model_cfg = _read_json(folder / "config.json")

    def special_id(name: str) -> int | None:
        for source in (tok_cfg, special_map):
            content = _token_content(source.get(name))
            if content is not None and backend.token_to_id(content) is not None:
                return backend.token_to_id(content)
        for source in (gen_cfg, model_cfg):
            ids = _id_list(source.get(f"{name}_id"))
            if ids:
                return ids[0]
        return None

    bos, eos, pad, unk = (
        special_id(n) for n in ("bos_token", "eos_token", "pad_token", "unk_token")
    )
    eos_ids = set(_id_list(gen_cfg.get("eos_token_id")) or _id_list(model_cfg.get("eos_token_id")))
    if eos is None and eos_ids:
        eos = min(eos_ids)
    add_bos = tok_cfg.get("add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = _post_processor_adds(backend, bos, first=True)
    add_eos = tok_cfg.get("add_eos_token")
    if not isinstance(add_eos, bool):
        add_eos = _post_processor_adds(backend, eos, first=False)
    # Loom adds BOS/EOS itself, so the post-processor must not add them a second time.
    backend.post_processor = None
    config = TokenizerConfig(
        bos_token_id=bos,
        eos_token_id=eos,
        eos_token_ids=frozenset(eos_ids | ({eos} if eos is not None else set())),
        pad_token_id=pad,
        unk_token_id=unk,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=_chat_template(folder, tok_cfg),
    )
    return Tokenizer(backend, config)
