"""Request handling before the routes: the body cap (413), API keys (401), and JSON bodies
sent without a JSON content type (curl's `-d`)."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException

from loom.server.errors import error_body

ASGIApp = Any


class BodySizeLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 before any handler reads it
    (by its Content-Length, or while it streams in)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """Pass the request on, or answer 413."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(send)
            return
        received = 0
        too_large = False

        async def counting_receive() -> dict:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise _BodyTooLarge(self.max_bytes)
            return message

        try:
            await self.app(scope, counting_receive, send)
        except _BodyTooLarge:
            await self._reject(send)

    async def _reject(self, send: Any) -> None:
        import json

        body = json.dumps(error_body(
            413, f"request body larger than {self.max_bytes} bytes (--max-request-body-bytes)"
        )).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(StarletteHTTPException):
    """Raised from `receive`: FastAPI re-raises HTTP exceptions from its body reader."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body larger than {max_bytes} bytes "
                              "(--max-request-body-bytes)")


def check_api_key(authorization: str | None, api_keys: tuple[str, ...]) -> str | None:
    """The key a request authenticates with ("" when the server has none), or None when it
    is missing or wrong."""
    if not api_keys:
        return ""
    if not authorization or not authorization.lower().startswith("bearer "):
        return None
    given = authorization[7:].strip()
    for key in api_keys:
        if hmac.compare_digest(given.encode(), key.encode()):
            return key
    return None


class JSONBodies:
    """ASGI middleware: a body sent as `application/x-www-form-urlencoded` or without a
    content type (what `curl -d` does) is read as JSON, as llama.cpp's server does; every
    route here takes JSON."""

    _FORM = b"application/x-www-form-urlencoded"

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """Pass the request on with a JSON content type where it had a form one or none."""
        if scope["type"] == "http" and scope.get("method") in ("POST", "PUT", "PATCH"):
            headers = [(k, v) for k, v in scope.get("headers") or []]
            kinds = [v for k, v in headers if k == b"content-type"]
            if not kinds or kinds[0].split(b";")[0].strip() == self._FORM:
                headers = [(k, v) for k, v in headers if k != b"content-type"]
                headers.append((b"content-type", b"application/json"))
                scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)
