"""What the HTTP routes share about an HTTP request: the server's state, the caller's API
key (a FastAPI dependency), and cancelling the work of a client that went away. The
services below the routes know none of this (they take the key as a string)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from loom.server.errors import APIError
from loom.server.state import ServerState

T = TypeVar("T")


def get_state(request: Request) -> ServerState:
    """The server's shared state."""
    return request.app.state.loom


def authenticated(request: Request) -> str:
    """Dependency: the caller's API key ("" without keys); 401 without a valid one."""
    return get_state(request).authenticate(request.headers.get("authorization"))


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its request) if the client leaves."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while not task.done():
            if await request.is_disconnected():
                task.cancel()
                return
            await asyncio.sleep(0.25)

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and task.cancelled():  # we cancelled it: the client is gone
            raise APIError(499, "the client closed the request") from None
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher

