"""`build_app`: the FastAPI application of `loom serve` over an `AsyncLLMEngine`."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

import loom
from loom.engine.async_engine import AsyncLLMEngine
from loom.server import openai_routes, response_routes, session_routes, session_socket
from loom.server.errors import install_error_handlers
from loom.server.limits import BodySizeLimit, JSONBodies
from loom.server.response_service import ResponseService
from loom.server.session_service import SessionService
from loom.server.state import ServerConfig, ServerState
from loom.tokenizer import ChatTemplate


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    """The HTTP API: OpenAI's endpoints, sessions, health, version and metrics."""
    from loom.server.metrics import ServerMetrics

    engine_config = engine.config
    # One template for the engine and every route: the server renders through the engine's
    # input processor, which holds it (state.chat_template reads it there).
    engine.inputs.chat_template = ChatTemplate.from_model(
        engine_config.model_path, engine_config.tokenizer_path, config.chat_template
    )
    state = ServerState(
        engine=engine,
        config=config,
        metrics=ServerMetrics(engine.engine, config.served_model_name),
    )
    app = FastAPI(
        title="Loom", version=loom.__version__,
        description="OpenAI-compatible API of the Loom inference engine, with live sessions.",
    )
    app.state.loom = state
    app.state.responses = ResponseService(state, config.response_ttl_s,
                                          config.max_stored_responses)
    app.state.sessions = SessionService(state)
    engine.on_ended.append(state.disown_session)
    install_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(session_routes.router)
    app.include_router(session_socket.router)
    app.include_router(response_routes.router)

    @app.get("/health")
    async def health() -> Response:
        """200 while the server can take requests."""
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> Any:
        """Loom's version."""
        return {"version": loom.__version__}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus metrics (engine gauges and counters, request histograms)."""
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    _document_errors(app)

    # The last added is the outermost: CORS headers reach every answer, a 413 included.
    app.add_middleware(JSONBodies)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_body_bytes)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])
    return app


# What each kind of route answers besides 200, in OpenAI's error body. FastAPI documents a
# 422 for every body it validates; Loom answers a malformed body with a 400 naming the field.
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


def _document_errors(app: FastAPI) -> None:
    """Make `/openapi.json` say what the server answers: no 422 (a bad body is a 400), and
    each route's error statuses with OpenAI's error body."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        error = {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]},
                           "code": {"type": ["string", "integer", "null"]}}}}}
        schema.setdefault("components", {}).setdefault("schemas", {})["Error"] = error
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
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
