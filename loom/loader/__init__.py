"""Model files (HF folders, GGUF) -> HF-style config dict and a stream of named tensors."""

from __future__ import annotations

from pathlib import Path

import torch

from loom.errors import ModelNotFoundError, UnsupportedModelError
from loom.loader.gguf_file import load_gguf
from loom.loader.hf import iter_safetensors, read_hf_config
from loom.loader.resolve import resolve_model_path
from loom.loader.source import ModelFiles, ModelSource, WeightIterator


def load_model_files(path: str | Path, dtype: torch.dtype | None = None) -> ModelFiles:
    """Open an HF folder or a .gguf file; unpacks as (hf_config, weights, source)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            path = ggufs[0]
        else:
            config = read_hf_config(path)
            weights = iter_safetensors(path, dtype)  # lazy: shards are listed on first use
            return ModelFiles(config, weights, ModelSource(path, "hf"))
    if path.suffix != ".gguf":
        raise UnsupportedModelError(f"{path} is neither an HF model folder nor a .gguf file")
    config, weights = load_gguf(path, dtype)
    return ModelFiles(config, weights, ModelSource(path, "gguf"))


__all__ = [
    "ModelFiles",
    "ModelSource",
    "WeightIterator",
    "load_model_files",
    "resolve_model_path",
]
