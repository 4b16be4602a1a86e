"""`KVConnectorBase`: vLLM V1's connector interface, both halves in one class.

The engine makes two instances of a connector class from one `KVTransferConfig`: one with
`KVConnectorRole.SCHEDULER` (given to the scheduler: finds what the store holds, decides
what to load and save each step; it must not touch tensors) and one with
`KVConnectorRole.WORKER` (given to the model runner: moves blocks between the store and the
KV pool). They talk only through the metadata `build_connector_meta` returns each step.

A step with a connector, in the runner:

    bind_connector_metadata(meta) -> start_load_kv() -> wait_for_layer_load(i) for each layer
    -> forward -> save_kv_layer(i, kv_cache[i], attn_metadata) for each layer
    -> wait_for_save() -> get_load_errors() -> clear_connector_metadata()

Any method may raise; the engine logs it and the fault stays with what the call concerns: a
match that raises is no match; a raise while planning or running a load fails that load (or
the step's loads) under `kv_load_failure_policy`; a raise while saving leaves blocks unsaved;
one in `request_finished` changes nothing (the blocks are freed).
"""

from __future__ import annotations

from typing import Any

from loom.core.kv_transfer import Range
from loom.core.request import Request
from loom.kv_connector.config import KVCacheSpec, KVConnectorRole, KVTransferConfig


class KVConnectorBase:
    """Subclass it and override what your store needs; the defaults do nothing."""

    def __init__(self, config: KVTransferConfig, spec: KVCacheSpec, role: KVConnectorRole):
        self.config = config
        self.spec = spec
        self.role = role
        self.load_failure_policy = config.kv_load_failure_policy
        self._metadata: Any = None

    # ---- scheduler side (no torch) -----------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens after `num_computed_tokens` the store can supply (whole blocks, never the
        last token), and whether the load is asynchronous (loads always run in the step
        after allocation here, before the request computes)."""
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: list[int], num_external_tokens: int
    ) -> None:
        """The request's table (`blocks`) now covers the matched tokens."""

    def get_computed_token_gaps(self, request: Request) -> list[Range] | None:
        """Token ranges inside the matched tokens that the store cannot supply."""
        return None

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """This step's work for the worker side."""
        return None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request ends (its blocks are freed right after: saves here are synchronous)."""
        return False, None

    # ---- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        """The KV pool: per layer a [2, num_blocks, block_size, kv heads, head dim] tensor."""
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """This step's metadata from the scheduler side."""
        self._metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """The step is over."""
        self._metadata = None

    def start_load_kv(self, **kwargs: Any) -> None:
        """Start loading this step's blocks into the KV pool."""

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Return once the layer's blocks are in place."""

    def save_kv_layer(self, layer_index: int, kv_layer: Any, attn_metadata: Any) -> None:
        """The layer's K/V for this step is written: save what the metadata asks."""

    def wait_for_save(self) -> None:
        """Return once this step's saves are done."""

    def get_load_errors(self) -> dict[int, str]:
        """Block id -> why its load failed, for this step's loads."""
        return {}
