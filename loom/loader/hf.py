"""Hugging Face model folders: config.json (+ generation_config.json) and safetensors."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from loom.errors import InvalidModelError, ModelNotFoundError
from loom.loader.source import WeightIterator
from loom.models.weight_shard import ShardRule, WeightSelector

# The safetensors library refuses headers larger than this (a bigger length is corruption).
_MAX_SAFETENSORS_HEADER = 100_000_000


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidModelError(f"{path}: not valid JSON ({error})") from None


def _read_json_object(path: Path) -> dict[str, Any]:
    data = _read_json(path)
    if not isinstance(data, dict):
        raise InvalidModelError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def read_hf_config(folder: Path) -> dict[str, Any]:
    """config.json as a dict; generation_config.json (if any) under key 'generation_config'."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelNotFoundError(f"{folder} has no config.json")
    config = _read_json_object(config_path)
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        config["generation_config"] = _read_json_object(gen_path)
    return config


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint shards: from model.safetensors.index.json if present, else *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise InvalidModelError(f"{index}: no 'weight_map' object")
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder} has no *.safetensors weights")
    return files


def check_safetensors_file(path: Path) -> None:
    """Raise `InvalidModelError` if the shard is missing, its header unreadable, or the file
    shorter than its header declares (reads the header only)."""
    if not path.is_file():
        raise InvalidModelError(f"{path}: missing, though the model's index lists it")
    size = path.stat().st_size
    hint = " (an interrupted download?)"
    with path.open("rb") as f:
        if size < 8:
            raise InvalidModelError(f"{path}: truncated: {size:,} of at least 8 bytes{hint}")
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > _MAX_SAFETENSORS_HEADER:
            raise InvalidModelError(
                f"{path}: corrupt safetensors header: it declares {header_len:,} header bytes"
            )
        if size < 8 + header_len:
            raise InvalidModelError(
                f"{path}: truncated: {size:,} of at least {8 + header_len:,} bytes; the"
                f" safetensors header runs past the end of the file{hint}"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
        ends = [
            int(entry["data_offsets"][1])
            for name, entry in header.items()
            if name != "__metadata__"
        ]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
        raise InvalidModelError(f"{path}: corrupt safetensors header ({error!r})") from None
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        raise InvalidModelError(f"{path}: truncated: {size:,} of {expected:,} bytes{hint}")


def iter_safetensors(folder: Path, dtype: torch.dtype | None = None,
                     select: WeightSelector | None = None) -> WeightIterator:
    """Yield (name, tensor) from each shard of `folder` in turn, cast to `dtype` when given.

    Every shard's header is checked before the first tensor is read, so a truncated or
    corrupt shard raises `InvalidModelError` (naming it) before any weights load. A tensor
    `select` names a part of is read as that part only (a tensor-parallel rank's rows or
    columns: the file is memory-mapped, so the rest is never read).
    """
    paths = safetensors_files(folder)
    for path in paths:
        check_safetensors_file(path)
    for path in paths:
        try:
            shard = safe_open(str(path), framework="pt")
        except SafetensorError as error:
            raise InvalidModelError(f"{path}: unreadable safetensors file ({error})") from None
        with shard as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                try:
                    rule = select(name) if select is not None else None
                    tensor = f.get_tensor(name) if rule is None else _read_part(f, name, rule)
                except SafetensorError as error:
                    raise InvalidModelError(
                        f"{path}: cannot read tensor {name!r} ({error})"
                    ) from None
                yield name, tensor if dtype is None else tensor.to(dtype)


def _read_part(f: Any, name: str, rule: ShardRule) -> torch.Tensor:
    """The part of tensor `name` that `rule` names, reading only that span."""
    if rule.first_rank_only:
        return rule.apply(f.get_tensor(name))
    view = f.get_slice(name)
    shape = view.get_shape()
    start, stop = rule.span(shape[rule.dim])
    index = [slice(None)] * len(shape)
    index[rule.dim] = slice(start, stop)
    return rule.pad(view[tuple(index)])
