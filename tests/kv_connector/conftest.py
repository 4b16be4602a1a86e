"""Fixtures for KV connector tests: a throwaway Redis server of our own on a loopback port."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from redis_process import RedisServer, start_redis


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A fresh, empty `redis-server` on a free loopback port for one test (it starts in a
    few milliseconds), stopped at teardown; skips the test when Debian's redis-server is
    not installed (`make test` installs it)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server not installed: apt-get install redis-server (make test "
                    "tries to) to run the Redis connector tests")
    folder = tmp_path_factory.mktemp("redis")
    for attempt in range(3):
        try:
            server = start_redis(binary, folder)
            break
        except RuntimeError:
            if attempt == 2:
                raise
    try:
        yield server
    finally:
        server.stop()
