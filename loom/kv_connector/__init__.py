"""KV connectors: K/V that outlives a request, in a folder or a Redis server (vLLM V1's
interface). See `docs/architecture.md` for how loads and gaps fit the scheduler's rule."""

from loom.errors import KVConnectorError
from loom.kv_connector.base import KVConnectorBase
from loom.kv_connector.config import KVCacheSpec, KVConnectorRole, KVTransferConfig
from loom.kv_connector.factory import create_connector, model_identity
from loom.kv_connector.store_connector import (
    RedisConnector,
    SharedStorageConnector,
    StoreConnector,
    StoreConnectorMetadata,
)

__all__ = [
    "KVCacheSpec",
    "KVConnectorBase",
    "KVConnectorError",
    "KVConnectorRole",
    "KVTransferConfig",
    "RedisConnector",
    "SharedStorageConnector",
    "StoreConnector",
    "StoreConnectorMetadata",
    "create_connector",
    "model_identity",
]
