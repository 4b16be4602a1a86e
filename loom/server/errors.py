"""OpenAI's error body (`{"error": {"message", "type", "param", "code"}}`) for every failure,
with the HTTP status that names its kind and a string `code` always.

An error never ends a kept-alive connection: an exception no handler maps is answered here
(`UnexpectedErrors`) as a 500, rather than by Starlette's last-resort handler, which
re-raises it after answering so that uvicorn drops the connection."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from loom.errors import (
    AuthenticationError,
    DuplicateRequestError,
    EngineShutDownError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    InvalidSessionStateError,
    LoomError,
    ModelNotFoundError,
    PromptTooLongError,
    QuotaExceededError,
    ReplicaUnavailableError,
    RequestFailedError,
    SessionLostError,
    UnknownRequestError,
)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}
# The `code` of an error raised without one.
_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    499: "client_closed_request",
    500: "internal_error",
    503: "service_unavailable",
}
# What a field holding an unpaired surrogate is told (protocol.RequestBody finds them).
UNPAIRED_SURROGATE = ("holds an unpaired UTF-16 surrogate (a lone \\ud800-\\udfff escape), "
                      "which is not Unicode text")

logger = logging.getLogger("loom.server")


class APIError(Exception):
    """An error the server answers with: status, message, and optionally the parameter."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _text(text: str | None) -> str | None:
    """`text` as UTF-8 can carry it: an unpaired surrogate (from a request) escaped."""
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The JSON body of an error response (its code a string: the status's when not given)."""
    return {"error": {"message": _text(message), "type": _TYPES.get(status, "error"),
                      "param": _text(param), "code": code or _CODES.get(status, "error")}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error as a response."""
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


# A Loom error's HTTP status and its code when it names none, by class (the first match).
_LOOM_STATUS: tuple[tuple[type[LoomError] | tuple[type[LoomError], ...], int, str], ...] = (
    (EngineShutDownError, 503, "engine_shut_down"),
    (ReplicaUnavailableError, 503, "replica_unavailable"),
    (RequestFailedError, 503, "request_failed"),
    (AuthenticationError, 401, "invalid_api_key"),
    (QuotaExceededError, 429, "rate_limit_exceeded"),
    (SessionLostError, 404, "session_lost"),
    (UnknownRequestError, 404, "not_found"),  # SessionClosedError included
    (ModelNotFoundError, 404, "model_not_found"),
    ((DuplicateRequestError, InvalidSessionStateError), 409, "conflict"),
    (PromptTooLongError, 400, "context_length_exceeded"),
    ((InvalidRequestError, InvalidSamplingParamsError), 400, "invalid_value"),
)


def from_loom_error(error: LoomError) -> APIError:
    """The HTTP form of a Loom error, the services' refusals included: its status by its
    class (401 no key, 404 unknown, closed or lost, 409 wrong state, 429 past a quota, 503
    the engine could not serve, 400 bad input), its code and the field it names."""
    message = str(error)
    status, code = 400, "invalid_request"
    for kinds, kind_status, kind_code in _LOOM_STATUS:
        if isinstance(error, kinds):
            status, code = kind_status, kind_code
            break
    param = error.param
    if param is None and isinstance(error, InvalidSamplingParamsError):
        match = re.search(r"invalid sampling parameter (\w+)=", message)
        param = match.group(1) if match else None
    return APIError(status, message, param=param, code=error.code or code)


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """One line per problem, each naming the field; the first field is `param`."""
    lines, param = [], None
    for item in error.errors():
        loc = []
        for part in item.get("loc", ())[1:]:  # after "body"; stop at a union member's tag
            if isinstance(part, int) or (isinstance(part, str) and part.isidentifier()):
                loc.append(str(part))
            else:
                break
        kind = item.get("type", "")
        if kind == "unpaired_surrogate":  # the path below the model that found it
            loc.append(item["ctx"]["field"])
        field = ".".join(loc)
        if kind == "json_invalid":
            return f"malformed JSON body: {item.get('ctx', {}).get('error', item['msg'])}", None
        if kind == "unpaired_surrogate":
            lines.append(f"invalid field '{field}': {UNPAIRED_SURROGATE}")
        elif kind == "extra_forbidden":
            lines.append(f"unknown field {field!r}")
        elif kind == "missing":
            lines.append(f"missing field {field!r}")
        else:
            lines.append(f"invalid field {field!r}: {item.get('msg')}")
        param = param or field or None
    return "; ".join(lines) or "invalid request body", param


def unpaired_surrogate(field: str) -> APIError:
    """The 400 for a field whose text holds an unpaired surrogate."""
    return APIError(400, f"invalid field '{field}': {UNPAIRED_SURROGATE}", param=field,
                    code="invalid_value")


def as_api_error(error: Exception) -> APIError:
    """What a stream reports when it ends in `error` after its headers went out: an
    APIError as it is, an engine error as `from_loom_error` maps it, anything else (a failed
    step) as a 503 naming it."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, LoomError):
        return from_loom_error(error)
    return APIError(503, f"the engine failed: {type(error).__name__}: {error}",
                    code="request_failed")


def invalid_body(error: ValidationError) -> APIError:
    """A body model's validation failure outside a route (a WebSocket message) as the 400
    an HTTP body gets, naming the field."""
    message, param = _validation_message(RequestValidationError(
        [{**item, "loc": ("body", *item.get("loc", ()))} for item in error.errors()]))
    return APIError(400, message, param=param, code="invalid_value")


async def _on_validation(request: Request, error: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(error)
    return error_response(400, message, param, code="invalid_value")


async def _on_api_error(request: Request, error: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return error_response(error.status, error.message, error.param, error.code, headers)


async def _on_loom_error(request: Request, error: LoomError) -> JSONResponse:
    return await _on_api_error(request, from_loom_error(error))


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _allowed_methods(request: Request) -> str:
    """The methods some route takes at the request's path (a 405's `Allow`): each method a
    route fully matches, over every route with the path (Starlette names the first's only)."""
    routes = request.app.router.routes
    allowed = [method for method in _METHODS if any(
        route.matches({**request.scope, "method": method})[0] is Match.FULL for route in routes)]
    return ", ".join(allowed)


async def _on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    message = error.detail if isinstance(error.detail, str) else "request failed"
    headers = dict(error.headers or {})
    if error.status_code == 404 and message == "Not Found":
        message = f"no route {request.method} {request.url.path}"
    if error.status_code == 405:
        headers["Allow"] = _allowed_methods(request)
        message = (f"method {request.method} not allowed on {request.url.path} "
                   f"(allowed: {headers['Allow']})")
    return error_response(error.status_code, message, headers=headers or None)


def internal_error(error: Exception) -> APIError:
    """The 500 for an exception nothing maps, naming it."""
    return APIError(500, f"internal error: {type(error).__name__}: {error}")


async def _on_unexpected(request: Request, error: Exception) -> JSONResponse:
    failure = internal_error(error)
    return error_response(failure.status, failure.message)


class UnexpectedErrors:
    """ASGI middleware: an HTTP request whose handler raises what no exception handler
    maps gets a 500 in OpenAI's body, logged with its traceback, and the connection stays
    open. Invariant: it re-raises only once the response has started (a half-sent answer
    can only end with its connection)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """Pass the request on; answer 500 for an exception raised before the response."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as error:
            if started:
                raise
            logger.exception("unexpected error in %s %s", scope.get("method"),
                             scope.get("path"))
            failure = internal_error(error)
            body = json.dumps(error_body(failure.status, failure.message)).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})


def install_error_handlers(app: Any) -> None:
    """Route every error through OpenAI's body; call before adding other middleware, so
    that `UnexpectedErrors` is the innermost (their headers, CORS's, reach its 500)."""
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(LoomError, _on_loom_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)  # what escapes the middleware
    app.add_middleware(UnexpectedErrors)
