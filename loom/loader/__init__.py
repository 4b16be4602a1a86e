"""Model files (HF folders, GGUF) -> HF-style config dict and a stream of named tensors."""

from __future__ import annotations

from pathlib import Path

import torch

from loom.errors import ModelNotFoundError, UnsupportedModelError
from loom.loader.gguf_file import gguf_is_quantized, load_gguf
from loom.loader.hf import iter_safetensors, read_hf_config
from loom.loader.resolve import resolve_model_path
from loom.loader.source import BlocksHook, ModelFiles, ModelSource, WeightIterator
from loom.models.weight_shard import WeightSelector


def locate_model_files(path: str | Path) -> ModelSource:
    """Where the weights are: an HF folder, or a .gguf file (a folder holding exactly one
    .gguf and no config.json counts as that file)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return ModelSource(ggufs[0], "gguf")
        return ModelSource(path, "hf")
    if path.suffix != ".gguf":
        raise UnsupportedModelError(f"{path} is neither an HF model folder nor a .gguf file")
    return ModelSource(path, "gguf")


def load_model_files(path: str | Path, dtype: torch.dtype | None = None,
                     select: WeightSelector | None = None,
                     keep_blocks: BlocksHook | None = None) -> ModelFiles:
    """Open an HF folder or a .gguf file; unpacks as (hf_config, weights, source). `select`:
    the part of each tensor to read (a tensor-parallel rank's shard), where the format lets
    a reader skip the rest. `keep_blocks`: told each quantised GGUF tensor's file blocks
    (see `iter_gguf_weights`; safetensors have none)."""
    source = locate_model_files(path)
    if source.format == "hf":
        config = read_hf_config(source.path)
        # lazy: shards are listed on first use
        weights = iter_safetensors(source.path, dtype, select)
        return ModelFiles(config, weights, source)
    config, weights = load_gguf(source.path, dtype, select, keep_blocks)
    return ModelFiles(config, weights, source)


def weights_are_quantized(path: str | Path) -> bool:
    """True when the file stores its weight matrices quantized (a GGUF Q4_K_M, Q8_0, ...);
    float checkpoints (HF safetensors, F32/F16/BF16 GGUFs) are not. Reads headers only."""
    source = locate_model_files(path)
    return source.format == "gguf" and gguf_is_quantized(source.path)


__all__ = [
    "BlocksHook",
    "ModelFiles",
    "ModelSource",
    "WeightIterator",
    "load_model_files",
    "locate_model_files",
    "resolve_model_path",
    "weights_are_quantized",
]
