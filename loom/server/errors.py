"""OpenAI's error body (`{"error": {"message", "type", "param", "code"}}`) for every failure,
with the HTTP status that names its kind."""

from __future__ import annotations

import re
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from loom.errors import (
    DuplicateRequestError,
    EngineShutDownError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    InvalidSessionStateError,
    LoomError,
    UnknownRequestError,
)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error the server answers with: status, message, and optionally the parameter."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The JSON body of an error response."""
    return {"error": {"message": message, "type": _TYPES.get(status, "error"),
                      "param": param, "code": code if code is not None else status}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error as a response."""
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


def from_loom_error(error: LoomError) -> APIError:
    """The HTTP form of an engine error: 404 for unknown or closed requests and sessions,
    409 for a session in the wrong state, 400 for bad input."""
    message = str(error)
    if isinstance(error, EngineShutDownError):
        return APIError(503, message, code="engine_shut_down")
    if isinstance(error, UnknownRequestError):  # includes SessionClosedError
        return APIError(404, message, code="not_found")
    if isinstance(error, DuplicateRequestError | InvalidSessionStateError):
        return APIError(409, message, code="conflict")
    param = None
    if isinstance(error, InvalidSamplingParamsError):
        match = re.search(r"invalid sampling parameter (\w+)=", message)
        param = match.group(1) if match else None
    if isinstance(error, InvalidRequestError | InvalidSamplingParamsError):
        return APIError(400, message, param=param, code="invalid_value")
    return APIError(400, message)


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
        field = ".".join(loc)
        kind = item.get("type", "")
        if kind == "json_invalid":
            return f"malformed JSON body: {item.get('ctx', {}).get('error', item['msg'])}", None
        if kind == "extra_forbidden":
            lines.append(f"unknown field {field!r}")
        elif kind == "missing":
            lines.append(f"missing field {field!r}")
        else:
            lines.append(f"invalid field {field!r}: {item.get('msg')}")
        param = param or field or None
    return "; ".join(lines) or "invalid request body", param


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


async def _on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    message = error.detail if isinstance(error.detail, str) else "request failed"
    if error.status_code == 404 and message == "Not Found":
        message = f"no route {request.method} {request.url.path}"
    if error.status_code == 405:
        message = f"method {request.method} not allowed on {request.url.path}"
    return error_response(error.status_code, message)


async def _on_unexpected(request: Request, error: Exception) -> JSONResponse:
    return error_response(500, f"internal error: {type(error).__name__}: {error}")


def install_error_handlers(app: Any) -> None:
    """Route every error through OpenAI's body."""
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(LoomError, _on_loom_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
