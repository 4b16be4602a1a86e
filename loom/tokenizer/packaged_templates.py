"""Chat templates Loom ships, for models whose own files carry none.

Gemma 3's GGUF conversions (the packaged 270M among them) have no `tokenizer.chat_template`.
A model gets Loom's Gemma 3 template (`templates/gemma3.jinja`) when both hold:

- its architecture is Gemma 3: a GGUF's `general.architecture` is `gemma3`, or a HF folder's
  `config.json` has `model_type` `gemma3` / `gemma3_text`;
- its vocabulary has the turn tokens the template writes, `<start_of_turn>` and
  `<end_of_turn>` (a Gemma 3 body with another tokenizer, like the tests' tiny random
  models, would get those strings split into ordinary pieces: no template for it).

A template the model's files carry, or `--chat-template FILE`, always comes first
(`ChatTemplate.from_model`).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from loom.errors import LoomError

GEMMA3_TEMPLATE = "gemma3.jinja"
_GEMMA3_MODEL_TYPES = frozenset({"gemma3", "gemma3_text"})
_GEMMA3_TURN_TOKENS = frozenset({"<start_of_turn>", "<end_of_turn>"})


def packaged_template_file(name: str) -> Path:
    """The path of a template shipped in `loom/tokenizer/templates` (e.g. `gemma3.jinja`)."""
    return Path(str(resources.files("loom.tokenizer").joinpath("templates", name)))


def fallback_template(paths: list[Path]) -> tuple[str, str] | None:
    """(template, origin) that Loom supplies for the model at one of `paths` (model and
    tokenizer paths: files or folders), or None when it has none for it."""
    if any(_is_gemma3(path) for path in paths):
        file = packaged_template_file(GEMMA3_TEMPLATE)
        return file.read_text(encoding="utf-8"), f"{file} (Loom's Gemma 3 template)"
    return None


def _is_gemma3(path: Path) -> bool:
    """Gemma 3 with its turn tokens, for a path as `ChatTemplate.from_model` takes them."""
    if path.is_file():
        return _gguf_is_gemma3(path) if path.suffix == ".gguf" else _hf_is_gemma3(path.parent)
    if path.is_dir():
        if (path / "config.json").is_file():
            return _hf_is_gemma3(path)
        ggufs = sorted(path.glob("*.gguf"))
        return len(ggufs) == 1 and _gguf_is_gemma3(ggufs[0])
    return False


def _gguf_is_gemma3(path: Path) -> bool:
    from loom.loader.gguf_reader import GGUFFile

    try:
        gguf = GGUFFile(path)
        if gguf.get("general.architecture") != "gemma3":
            return False
        tokens = gguf.get("tokenizer.ggml.tokens")  # 0.2 s for Gemma's 262k; only here
    except LoomError:
        return False
    return isinstance(tokens, list) and set(tokens) >= _GEMMA3_TURN_TOKENS


def _hf_is_gemma3(folder: Path) -> bool:
    if read_json_object(folder / "config.json").get("model_type") not in _GEMMA3_MODEL_TYPES:
        return False
    # The turn tokens are added tokens: listed in tokenizer_config.json (small), else in
    # tokenizer.json (tens of MB for Gemma; read only when the first lacks them).
    decoder = read_json_object(folder / "tokenizer_config.json").get("added_tokens_decoder")
    entries = list(decoder.values()) if isinstance(decoder, dict) else []
    if not _contents(entries) >= _GEMMA3_TURN_TOKENS:
        added = read_json_object(folder / "tokenizer.json").get("added_tokens")
        entries += added if isinstance(added, list) else []
    return _contents(entries) >= _GEMMA3_TURN_TOKENS


def _contents(entries: list[Any]) -> set[str]:
    """The token strings of added-token entries (`{"content": ...}`)."""
    return {e["content"] for e in entries if isinstance(e, dict) and isinstance(
        e.get("content"), str)}


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file's top-level object; {} when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
