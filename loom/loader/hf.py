"""Hugging Face model folders: config.json (+ generation_config.json) and safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from loom.errors import ModelNotFoundError
from loom.loader.source import WeightIterator


def read_hf_config(folder: Path) -> dict[str, Any]:
    """config.json as a dict; generation_config.json (if any) under key 'generation_config'."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelNotFoundError(f"{folder} has no config.json")
    config: dict[str, Any] = json.loads(config_path.read_text())
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        config["generation_config"] = json.loads(gen_path.read_text())
    return config


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint shards: from model.safetensors.index.json if present, else *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder} has no *.safetensors weights")
    return files


def iter_safetensors(folder: Path, dtype: torch.dtype | None = None) -> WeightIterator:
    """Yield (name, tensor) from each shard of `folder` in turn, cast to `dtype` when given."""
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = f.get_tensor(name)
                yield name, tensor if dtype is None else tensor.to(dtype)
