"""`build_app`: the FastAPI application of `loom serve` over an engine client (one engine in
process, `AsyncLLMEngine`, or replicas behind Ray Serve, `RayEngineClient`)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

import loom
from loom.engine.client import EngineClient
from loom.server import (
    embedding_routes,
    openai_routes,
    response_routes,
    session_routes,
    session_socket,
)
from loom.server.api_docs import document_responses
from loom.server.engine_scope import EngineScope
from loom.server.errors import install_error_handlers
from loom.server.harmony_chat import HarmonyChat
from loom.server.limits import BodySizeLimit, JSONBodies
from loom.server.reasoning import select_parser
from loom.server.response_service import ResponseService
from loom.server.session_service import SessionService
from loom.server.state import ServerConfig, ServerState
from loom.tokenizer import ChatTemplate


def build_app(engine: EngineClient, config: ServerConfig) -> FastAPI:
    """The HTTP API: OpenAI's endpoints, sessions, health, version and metrics."""
    from loom.server.metrics import MetricsExporter

    engine_config = engine.config
    # One template for the engine and every route: the server renders through the engine's
    # input processor, which holds it (state.chat_template reads it there).
    engine.inputs.chat_template = ChatTemplate.from_model(
        engine_config.model_path, engine_config.tokenizer_path, config.chat_template
    )
    template = engine.inputs.chat_template
    # A harmony model (gpt-oss: its vocabulary carries the format's tokens) is served in its
    # format, unless a chat template given on the command line says otherwise.
    harmony = None if config.chat_template else HarmonyChat.for_tokenizer(engine.tokenizer)
    state = ServerState(
        engine=engine,
        config=config,
        metrics=MetricsExporter(engine_config, config.served_model_name),
        reasoning=None if harmony is not None else select_parser(
            config.reasoning_parser, template.template if template is not None else None),
        harmony=harmony,
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
    app.include_router(embedding_routes.router)
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
        body, content_type = state.metrics.render(await state.engine.readings())
        return Response(body, media_type=content_type)

    document_responses(app)

    # The last added is the outermost: CORS headers reach every answer, a 413 included.
    app.add_middleware(EngineScope)
    app.add_middleware(JSONBodies)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_body_bytes)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])
    return app
