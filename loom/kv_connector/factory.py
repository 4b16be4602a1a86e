"""Make a connector instance by name, or from a user's module (`kv_connector_module_path`)."""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path

from loom.errors import KVConnectorError, LoomError
from loom.kv_connector.base import KVConnectorBase
from loom.kv_connector.config import KVCacheSpec, KVConnectorRole, KVTransferConfig
from loom.kv_connector.store_connector import RedisConnector, SharedStorageConnector

BUILTIN_CONNECTORS: dict[str, type[KVConnectorBase]] = {
    "SharedStorageConnector": SharedStorageConnector,
    "RedisConnector": RedisConnector,
}


def connector_class(config: KVTransferConfig) -> type[KVConnectorBase]:
    """The class `config` names: built in, or `kv_connector` inside `kv_connector_module_path`."""
    name, module_path = config.kv_connector, config.kv_connector_module_path
    if module_path is None:
        if name not in BUILTIN_CONNECTORS:
            raise KVConnectorError(
                f"unknown KV connector {name!r}; built in: {sorted(BUILTIN_CONNECTORS)} "
                "(or give kv_connector_module_path for your own class)"
            )
        return BUILTIN_CONNECTORS[name]
    try:
        module = importlib.import_module(module_path)
    except ImportError as error:
        raise KVConnectorError(
            f"cannot import kv_connector_module_path {module_path!r}: {error}"
        ) from None
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise KVConnectorError(
            f"module {module_path!r} has no KV connector class {name!r} "
            "(a subclass of loom.kv_connector.KVConnectorBase)"
        )
    return cls


def create_connector(
    config: KVTransferConfig, spec: KVCacheSpec, role: KVConnectorRole
) -> KVConnectorBase:
    """An instance of the configured connector for one role."""
    cls = connector_class(config)
    try:
        return cls(config, spec, role)
    except LoomError:
        raise
    except Exception as error:
        raise KVConnectorError(
            f"KV connector {config.kv_connector!r} failed to start: {error}"
        ) from error


def model_identity(path: Path) -> str:
    """A cheap identity of model weights: each weight file's name, size, first and last MiB
    (two copies of the same weights agree; other weights or a re-quantisation do not)."""
    files = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.gguf")) \
        if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()[:32]
