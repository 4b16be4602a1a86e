"""Chained hashes of full KV blocks: the keys of the prefix cache (and of external KV stores).

Block i of a request holds the K/V of tokens [i * B, (i + 1) * B). Its K/V depends on every
token before it, so its key chains the previous block's key with its own tokens:

    key(0) = H(ROOT || tokens[0:B])      key(i) = H(key(i - 1) || tokens[i*B:(i+1)*B])

Two requests whose keys for block i agree hold the same tokens at positions [0, (i+1) * B)
and therefore the same K/V there. Keys are 16-byte BLAKE2b digests of little-endian 32-bit
token ids: stable across processes and machines (the KV connector stores blocks under them).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_KEY = b"loom-kv-v1"


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The key of a full block holding `token_ids`, after the block keyed `parent`."""
    digest = hashlib.blake2b(parent if parent is not None else ROOT_KEY, digest_size=16)
    digest.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return digest.digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, num_blocks: int
) -> list[bytes]:
    """Extend `hashes` (keys of the first blocks of `token_ids`) to cover `num_blocks` full
    blocks, computing only the missing keys; returns the same list."""
    for i in range(len(hashes), num_blocks):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes
