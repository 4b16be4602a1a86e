"""Encode one KV block as safetensors bytes with its fingerprint and checksum; decode and
verify it, naming what is wrong when it cannot be used."""

from __future__ import annotations

import hashlib
import json
import struct

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from loom.errors import LoomError
from loom.kv_connector.config import KVCacheSpec

FORMAT = "loom-kv-block-1"
_TENSOR = "kv"


class KVBlockError(LoomError):
    """A stored block that cannot be loaded (missing, corrupt, or saved for other KV)."""


def _checksum(tensor: torch.Tensor) -> str:
    raw = tensor.contiguous().view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(raw)).hexdigest()


def encode_block(tensor: torch.Tensor, spec: KVCacheSpec) -> bytes:
    """Bytes of a [layers, 2, block_size, kv heads, head dim] block on the CPU."""
    tensor = tensor.detach().to("cpu").contiguous()
    metadata = {"format": FORMAT, "fingerprint": spec.fingerprint, "sha256": _checksum(tensor)}
    return save_safetensors({_TENSOR: tensor}, metadata=metadata)


def safetensors_header(data: bytes, error: type[LoomError] = KVBlockError,
                       what: str = "block file") -> dict:
    """The safetensors JSON header (8-byte little-endian length, then a JSON object) of
    `data`; `error` naming `what` when the bytes are truncated or the header is not one."""
    if len(data) < 8:
        raise error(f"truncated {what} ({len(data)} bytes)")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise error(f"truncated {what} (header of {size} bytes, {len(data)} in all)")
    try:
        header = json.loads(data[8 : 8 + size])
    except ValueError as exc:
        raise error(f"corrupt {what} header: {exc}") from None
    if not isinstance(header, dict):
        raise error(f"corrupt {what} header: not a JSON object")
    return header


def decode_block(data: bytes, spec: KVCacheSpec) -> torch.Tensor:
    """The block tensor, after checking format, fingerprint, shape, dtype and checksum."""
    metadata = safetensors_header(data).get("__metadata__") or {}
    if metadata.get("format") != FORMAT:
        raise KVBlockError(f"not a Loom KV block (format {metadata.get('format')!r})")
    if metadata.get("fingerprint") != spec.fingerprint:
        raise KVBlockError(
            f"saved for other KV (model, dtype, block size or layer shapes): fingerprint "
            f"{metadata.get('fingerprint')!r}, expected {spec.fingerprint!r}"
        )
    try:
        tensor = load_safetensors(data)[_TENSOR]
    except Exception as error:  # safetensors raises its own error types for bad payloads
        raise KVBlockError(f"corrupt block file: {error}") from None
    if tuple(tensor.shape) != spec.block_shape:
        raise KVBlockError(f"wrong shape {tuple(tensor.shape)}, expected {spec.block_shape}")
    if str(tensor.dtype).removeprefix("torch.") != spec.kv_cache_dtype:
        raise KVBlockError(f"wrong dtype {tensor.dtype}, expected {spec.kv_cache_dtype}")
    if _checksum(tensor) != metadata.get("sha256"):
        raise KVBlockError("checksum mismatch: the block's bytes changed after it was saved")
    return tensor
