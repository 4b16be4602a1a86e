"""Connectors that keep one entry per KV block in a byte store, keyed by the block's chained
hash under the model fingerprint: `SharedStorageConnector` (a folder) and `RedisConnector`.

A lookup walks the request's full blocks after its frontier and matches up to the last one
the store holds; the blocks it lacks before that are gaps, computed by the engine (segmented
prefill). Every block a step fills is saved after the forward unless the store has it.

The step's metadata names blocks by their chained hash, not by key: each worker half keys them
with its own fingerprint, so under tensor parallelism every rank loads and saves its own KV
heads under its own keys (the scheduler half looks up every rank's).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from loom.core.kv_transfer import Range, blocks_to_ranges
from loom.core.request import Request
from loom.core.scheduler_output import SchedulerOutput
from loom.kv_connector.base import KVConnectorBase
from loom.kv_connector.config import KVCacheSpec, KVConnectorRole, KVTransferConfig
from loom.kv_connector.store import FileStore, KVStore, RedisStore

logger = logging.getLogger(__name__)


@dataclass
class StoreConnectorMetadata:
    """One step's transfers: (block id, block hash) pairs to load before and save after the
    forward. Each worker keys the hashes with its own fingerprint (`StoreConnector.key`)."""

    loads: list[tuple[int, bytes]] = field(default_factory=list)
    saves: list[tuple[int, bytes]] = field(default_factory=list)


@dataclass
class _Match:
    """What a lookup found for a request: table index -> hash of each stored block, and gaps."""

    hashes: dict[int, bytes]
    gaps: list[Range]


class StoreConnector(KVConnectorBase):
    """The connector logic over any `KVStore`; subclasses say which store."""

    def __init__(self, config: KVTransferConfig, spec: KVCacheSpec, role: KVConnectorRole):
        super().__init__(config, spec, role)
        self.store = self.make_store(dict(config.kv_connector_extra_config))
        self._matches: dict[str, _Match] = {}
        self._loads: list[tuple[int, bytes]] = []
        self._load_errors: dict[int, str] = {}
        self.num_saved_blocks = 0
        self.num_save_errors = 0
        # The fingerprint of every tensor-parallel rank's entries (one without parallelism).
        self._rank_fingerprints = [
            dataclasses.replace(spec, tensor_parallel_rank=r).fingerprint
            for r in range(spec.tensor_parallel_size)]

    def make_store(self, extra_config: dict[str, Any]) -> KVStore:
        """The store this connector reads and writes."""
        raise NotImplementedError

    def key(self, block_hash: bytes) -> str:
        """The store key of a block: the KV fingerprint, then the block's chained hash."""
        return f"{self.spec.fingerprint}/{block_hash.hex()}"

    def _held(self, hashes: list[bytes]) -> list[bool]:
        """Whether the store holds each block for every tensor-parallel rank (each rank's
        K/V is its own entry, under its own fingerprint): one rank's missing entry makes the
        block missing, so it is computed and saved again rather than matched and failed."""
        fingerprints = self._rank_fingerprints
        found = self.store.contains([f"{f}/{h.hex()}" for f in fingerprints for h in hashes])
        n = len(hashes)
        return [all(found[r * n + i] for r in range(len(fingerprints))) for i in range(n)]

    # ---- scheduler side -----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Up to the last full block before the last token that the store holds."""
        self._matches.pop(request.request_id, None)
        size = self.spec.block_size
        first, last = num_computed_tokens // size, (request.num_tokens - 1) // size
        if not self.config.is_consumer or last <= first:
            return 0, False
        hashes = request.block_keys(size, last)[first:last]
        try:
            held = self._held(hashes)
        except Exception as error:  # an unreachable store must not stop the engine
            logger.warning("KV store lookup failed, computing instead: %s", error)
            return 0, False
        found = [first + i for i, ok in enumerate(held) if ok]
        if not found:
            return 0, False
        end = found[-1] + 1
        missing = sorted(set(range(first, end)) - set(found))
        self._matches[request.request_id] = _Match(
            hashes={i: hashes[i - first] for i in found}, gaps=blocks_to_ranges(missing, size)
        )
        return end * size - num_computed_tokens, False

    def get_computed_token_gaps(self, request: Request) -> list[Range] | None:
        """The blocks the store lacked inside the match."""
        match = self._matches.get(request.request_id)
        return list(match.gaps) if match and match.gaps else None

    def update_state_after_alloc(
        self, request: Request, blocks: list[int], num_external_tokens: int
    ) -> None:
        """Queue the matched blocks outside the gaps for loading in this step."""
        match = self._matches.get(request.request_id)
        if match is None or not num_external_tokens:
            return
        size = self.spec.block_size
        gaps = self.get_computed_token_gaps(request) or []
        skip = {i for a, b in gaps for i in range(a // size, -(-b // size))}
        self._loads.extend(
            (blocks[i], h) for i, h in sorted(match.hashes.items()) if i not in skip
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StoreConnectorMetadata:
        """This step's loads, and saves of the blocks it fills that the store lacks."""
        meta = StoreConnectorMetadata(loads=self._loads)
        self._loads = []
        if self.config.is_producer and scheduler_output.filled_blocks:
            saves = [(b.block_id, b.block_hash) for b in scheduler_output.filled_blocks]
            try:
                held = self._held([h for _, h in saves])
            except Exception as error:
                logger.warning("KV store lookup failed, not saving this step: %s", error)
                held = [True] * len(saves)
            meta.saves = [s for s, ok in zip(saves, held, strict=True) if not ok]
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request's lookup (saves are done within each step)."""
        self._matches.pop(request.request_id, None)
        return False, None

    # ---- worker side --------------------------------------------------------------------

    def start_load_kv(self, **kwargs: Any) -> None:
        """Load every block of this step (synchronously: the requests wait a step anyway);
        a block that is missing, corrupt or saved for other KV is recorded, not raised."""
        import torch

        from loom.kv_connector.codec import KVBlockError, decode_block

        self._load_errors = {}
        meta: StoreConnectorMetadata | None = self._metadata
        if meta is None or not meta.loads:
            return
        store_error: str | None = None  # once the store fails, the step's other reads are moot
        for block_id, block_hash in meta.loads:
            key = self.key(block_hash)  # this rank's key
            if store_error is not None:
                self._load_errors[block_id] = f"{key}: {store_error}"
                continue
            try:
                data = self.store.get(key)
            except Exception as error:  # a lost server, an I/O error
                store_error = f"the store failed: {type(error).__name__}: {error}"
                self._load_errors[block_id] = f"{key}: {store_error}"
                continue
            try:
                if data is None:
                    raise KVBlockError("missing from the store")
                block = decode_block(data, self.spec)
            except Exception as error:  # this block is bad (KVBlockError); the others load
                self._load_errors[block_id] = f"{key}: {error}"
                continue
            with torch.inference_mode():
                for layer, cache in enumerate(self.kv_caches):
                    cache[:, block_id].copy_(block[layer], non_blocking=True)

    def save_kv_layer(self, layer_index: int, kv_layer: Any, attn_metadata: Any) -> None:
        """Nothing per layer: `wait_for_save` gathers each block across layers."""

    def wait_for_save(self) -> None:
        """Encode and store every block this step filled; a failed write is logged."""
        import torch

        from loom.kv_connector.codec import encode_block

        meta: StoreConnectorMetadata | None = self._metadata
        if meta is None or not meta.saves:
            return
        for block_id, block_hash in meta.saves:
            key = self.key(block_hash)  # this rank's key
            try:
                with torch.inference_mode():
                    block = torch.stack([cache[:, block_id] for cache in self.kv_caches])
                self.store.put(key, encode_block(block, self.spec))
                self.num_saved_blocks += 1
            except Exception as error:  # a full disk or a lost server must not stop the engine
                self.num_save_errors += 1
                logger.warning("saving KV block %s failed: %s", key, error)

    def get_load_errors(self) -> dict[int, str]:
        """Block id -> cause, for this step's loads."""
        return dict(self._load_errors)


class SharedStorageConnector(StoreConnector):
    """Blocks as safetensors files under `kv_connector_extra_config["shared_storage_path"]`."""

    def make_store(self, extra_config: dict[str, Any]) -> KVStore:
        """A `FileStore` at the configured folder (default "local_storage")."""
        return FileStore(extra_config.get("shared_storage_path", "local_storage"))


class RedisConnector(StoreConnector):
    """Blocks as values in a Redis server: `kv_connector_extra_config` takes "url" (such as
    "redis://127.0.0.1:6379/0") or "host", "port", "db", and "socket_timeout" seconds."""

    def make_store(self, extra_config: dict[str, Any]) -> KVStore:
        """A `RedisStore` from the configured address."""
        return RedisStore(**extra_config)
