"""Byte stores a connector keeps blocks in, keyed by "<fingerprint>/<block hash hex>".

No torch here: the scheduler side asks a store which keys it holds.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from loom.errors import MissingDependencyError


class KVStore(Protocol):
    """Get, put and look up encoded blocks by key."""

    def get(self, key: str) -> bytes | None:
        """The value, or None when the store lacks the key."""
        ...

    def put(self, key: str, value: bytes) -> None:
        """Store the value under the key (replacing any)."""
        ...

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether the store holds it."""
        ...

    def delete(self, key: str) -> None:
        """Remove the key (nothing when the store lacks it)."""
        ...


class FileStore:
    """One file per key under a folder: `<root>/<fingerprint>/<hash>.safetensors`.

    A write goes to a temporary file in the same folder and is renamed over the final name,
    so a reader sees a whole file or none (a crash leaves only a stray temporary file)."""

    SUFFIX = ".safetensors"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, key: str) -> Path:
        """Where the key's file lives."""
        return self.root / f"{key}{self.SUFFIX}"

    def get(self, key: str) -> bytes | None:
        """The file's bytes, or None when it does not exist."""
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None

    def put(self, key: str, value: bytes) -> None:
        """Write atomically: temporary file, flush, rename."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(value)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key's file exists."""
        return [self.path(key).is_file() for key in keys]

    def delete(self, key: str) -> None:
        """Remove the key's file."""
        self.path(key).unlink(missing_ok=True)


class RedisStore:
    """Keys in a Redis server (the `redis` client; `pip install 'loom-llm[redis]'`).

    A failed call is not retried (`retries`, default 0): the engine computes what it cannot
    load, so waiting seconds on a lost server only delays every request."""

    def __init__(self, url: str | None = None, host: str = "127.0.0.1", port: int = 6379,
                 db: int = 0, socket_timeout: float = 2.0, retries: int = 0,
                 **kwargs: Any) -> None:
        try:
            import redis
            from redis.backoff import ExponentialBackoff
            from redis.retry import Retry
        except ImportError as error:
            raise MissingDependencyError(
                "RedisConnector needs the redis client: pip install 'loom-llm[redis]'"
            ) from error
        options = {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_timeout,
                   "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), retries), **kwargs}
        if url is not None:
            self.client = redis.Redis.from_url(url, **options)
        else:
            self.client = redis.Redis(host=host, port=port, db=db, **options)

    def get(self, key: str) -> bytes | None:
        """The value, or None for a missing key."""
        return self.client.get(key)

    def put(self, key: str, value: bytes) -> None:
        """SET the key."""
        self.client.set(key, value)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """EXISTS for each key, in one round trip."""
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(n) for n in pipe.execute()]

    def delete(self, key: str) -> None:
        """DEL the key."""
        self.client.delete(key)
