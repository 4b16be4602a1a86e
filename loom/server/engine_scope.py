"""`EngineScope`: the engine calls of one HTTP request share a `CallScope`.

A request's `x-session-id` header (vLLM's and Ray Serve LLM's session affinity header) is the
scope's affinity key: behind several replicas, the new requests made under one key reach
one replica (the engine client pins the key to the first one's), so an agent's turns find
their prefix cache. The response's `x-loom-replica` header names the replica that served the
request's last engine call; an in-process engine notes none, so it gets no such header.
"""

from __future__ import annotations

from typing import Any

from loom.engine.client import call_scope

ASGIApp = Any
SESSION_HEADER = b"x-session-id"
REPLICA_HEADER = b"x-loom-replica"


class EngineScope:
    """ASGI middleware: one `CallScope` per HTTP request or WebSocket connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """Run the request inside its scope; name the serving replica in the response."""
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        key = dict(scope.get("headers") or []).get(SESSION_HEADER)
        with call_scope(key.decode("latin-1") if key else None) as calls:

            async def naming_send(message: dict) -> None:
                if message["type"] == "http.response.start" and calls.served:
                    headers = [*message.get("headers", []),
                               (REPLICA_HEADER, calls.served[-1].encode("latin-1"))]
                    message = {**message, "headers": headers}
                await send(message)

            await self.app(scope, receive, naming_send)
