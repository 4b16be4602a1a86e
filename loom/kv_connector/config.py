"""`KVTransferConfig` (vLLM's names) and the description of the KV a connector moves."""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from loom.errors import InvalidRequestError

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOAD_FAILURE_POLICIES = ("recompute", "fail")


class KVConnectorRole(enum.Enum):
    """Which half of a connector an instance is: the scheduler's (lookups, what to load and
    save; no torch) or the worker's (moves tensors between the store and the KV pool)."""

    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(frozen=True)
class KVTransferConfig:
    """Which connector to use and how, as `EngineArgs(kv_transfer_config=...)` takes it.

    `kv_connector` names a built-in connector ("SharedStorageConnector", "RedisConnector") or,
    with `kv_connector_module_path`, a class of that name in a user's module. `kv_role`:
    a "kv_producer" only saves, a "kv_consumer" only loads, "kv_both" does both. When a load
    fails, "recompute" computes the missing tokens (the output is unchanged) and "fail" fails
    the request with an error naming the block and the cause.
    """

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self) -> None:
        if not self.kv_connector:
            raise InvalidRequestError("kv_transfer_config: kv_connector must name a connector")
        if self.kv_role not in KV_ROLES:
            raise InvalidRequestError(
                f"kv_transfer_config: unknown kv_role {self.kv_role!r}; choose one of {KV_ROLES}"
            )
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise InvalidRequestError(
                f"kv_transfer_config: unknown kv_load_failure_policy "
                f"{self.kv_load_failure_policy!r}; choose one of {LOAD_FAILURE_POLICIES}"
            )

    @classmethod
    def coerce(cls, value: KVTransferConfig | dict[str, Any]) -> KVTransferConfig:
        """The config as given, or built from a dict of its field names (a JSON config)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(
                f"kv_transfer_config must be a KVTransferConfig or a dict, got "
                f"{type(value).__name__}"
            )
        try:
            return cls(**value)
        except TypeError as error:
            raise InvalidRequestError(f"kv_transfer_config: {error}") from None

    @property
    def is_producer(self) -> bool:
        """Saves the K/V it computes."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """Loads K/V the store holds."""
        return self.kv_role in ("kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVCacheSpec:
    """What a stored block must match to be loaded: the weights, everything that changes
    the numbers (dtypes, quantization, prefill dtype, kernels) and the KV layout.

    A block is one tensor of `block_shape` = [layers, 2 (K, V), block_size, kv heads, head
    dim] in `kv_cache_dtype`."""

    model_id: str  # identity of the weights (see loom.kv_connector.fingerprint.model_identity)
    dtype: str
    kv_cache_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # The weights' mode (None, "int8", "w8a8", "w4a8"): K/V computed from quantised weights
    # differ from the float ones, so a store never mixes them.
    quantization: str | None = None
    # The dtype prefill chunks and large batches multiplied in (`prefill_dtype`; None: the
    # same arithmetic as decode): K/V from a bf16 prefill differ from K/V computed in int8 /
    # float32, so an engine with the other setting loads none of them.
    large_batch_dtype: str | None = None
    # Which kernels computed the K/V: `loom.kernels.KERNEL_ARITHMETIC` for Loom's C kernels
    # (bumped whenever a kernel change can move a bit), else "torch-<device type>", then
    # "/<attention backend asked for>". The same mode on other kernels gives other bits, and a
    # store never mixes them.
    arithmetic: str = ""
    # Tensor parallelism: each rank stores the blocks of its own KV heads (`num_kv_heads` is
    # the rank's) under its own keys; a block written under another tensor-parallel size or by
    # another rank never matches. Left out of the fingerprint at size 1, so one-device stores
    # keep their keys.
    tensor_parallel_rank: int = 0
    tensor_parallel_size: int = 1

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one stored block."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def fingerprint(self) -> str:
        """A short digest of every field: stored keys start with it, blocks carry it."""
        fields = asdict(self)
        if self.tensor_parallel_size == 1:
            del fields["tensor_parallel_rank"], fields["tensor_parallel_size"]
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]
