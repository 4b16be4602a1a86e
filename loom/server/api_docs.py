"""What `/openapi.json` says each route takes and answers: request bodies with the rules the
server checks beyond each field's type and this server's limits (`api_request_rules`), its
200 body (a schema per route, and the event stream where a route streams: `api_bodies`), its
error statuses with OpenAI's error body, and no 422 (a malformed body is a 400 naming the
field).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from loom.server.api_bodies import PLAIN_TEXT, RESPONSES
from loom.server.api_request_rules import document_requests

# What each kind of route answers besides 200, in OpenAI's error body.
_ERRORS_EVERY_ROUTE = {"401": "missing or invalid API key (when --api-key is set)",
                       "413": "request body over --max-request-body-bytes"}
_ERRORS_WITH_BODY = {"400": "invalid request: the message names the field",
                     "404": "unknown model", "503": "the engine could not serve the request"}
_ERRORS_BY_PREFIX = {
    "/v1/sessions": {"404": "unknown session (or another key's)",
                     "409": "the session is in the wrong state (generating)",
                     "429": "too many open sessions for this key"},
    "/v1/responses": {"404": "unknown response or previous_response_id",
                      "409": "the response is still in progress"},
}
_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]},
                   "code": {"type": "string"}}}}}


def _component(schemas: dict[str, Any], model: type[BaseModel]) -> dict[str, str]:
    """Add the model (and the models it uses) to the components; its reference."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in schema.pop("$defs", {}).items():
        schemas.setdefault(name, sub)
    schemas.setdefault(model.__name__, schema)
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _ok(schemas: dict[str, Any], method: str, path: str) -> dict[str, Any] | None:
    """The documented 200 of a route, or None for a route not in the tables."""
    if (method, path) in PLAIN_TEXT:
        return {"description": PLAIN_TEXT[(method, path)],
                "content": {"text/plain": {"schema": {"type": "string"}}}}
    if (method, path) not in RESPONSES:
        return None
    models, streams = RESPONSES[(method, path)]
    refs = [_component(schemas, m) for m in models]
    content: dict[str, Any] = {"application/json": {
        "schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}}
    if streams:
        content["text/event-stream"] = {"schema": {
            "type": "object", "required": ["data"],
            "description": "with `stream: true`, one server-sent event: `data` is a JSON "
            "chunk of the body (or a Responses API event); the stream ends with `data: "
            "[DONE]` (the Responses API with `response.completed`)",
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}
    return {"description": models[0].__doc__.strip().splitlines()[0] if models[0].__doc__
            else "OK", "content": content}


def document_responses(app: FastAPI) -> None:
    """Make `/openapi.json` say what each route answers (see the module docstring)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        document_requests(schemas, app.state.loom)
        schemas["Error"] = _ERROR_SCHEMA
        for path, operations in schema.get("paths", {}).items():
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                ok = _ok(schemas, method, path)
                if ok is not None:
                    responses["200"] = ok
                errors = dict(_ERRORS_EVERY_ROUTE)
                if "requestBody" in operation or operation.get("parameters"):
                    errors.update(_ERRORS_WITH_BODY)
                for prefix, extra in _ERRORS_BY_PREFIX.items():
                    if path.startswith(prefix):
                        errors.update(extra)
                for status, description in errors.items():
                    responses.setdefault(status, {
                        "description": description,
                        "content": {"application/json": {
                            "schema": {"$ref": "#/components/schemas/Error"}}}})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
