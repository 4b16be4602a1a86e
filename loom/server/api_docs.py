"""What `/openapi.json` says each route answers: its 200 body (a schema per route, and the
event stream where a route streams), its error statuses with OpenAI's error body, and no
422 (a malformed body is a 400 naming the field).

The response models below document; the routes build their bodies as dicts and nothing
validates them at run time (the schema-driven test checks real answers against these
schemas). Fields a body carries only sometimes are optional; objects allow fields not named
here (OpenAI's shapes grow), so a client generated from the schema reads every answer.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int | None = None


class CompletionLogprobs(_Body):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's prompt logprobs: per prompt position None (the first) or {token id: entry}.
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class Completion(_Body):
    """`POST /v1/completions` (with `stream: true`, `text/event-stream` chunks of the same
    shape and `data: [DONE]`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None
    children: list[Any] | None = None  # `<promise>` children per prompt (Loom's extension)


class ChatMessageOut(_Body):
    role: str
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(_Body):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletion(_Body):
    """`POST /v1/chat/completions` (streamed: `chat.completion.chunk` events)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str | None = None
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    children: list[Any] | None = None


class ModelCard(_Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(_Body):
    object: Literal["list"]
    data: list[ModelCard]


class Tokenized(_Body):
    tokens: list[int]
    count: int
    max_model_len: int


class Detokenized(_Body):
    prompt: str


class TokenizerInfo(_Body):
    """`GET /tokenizer_info` (vLLM's)."""

    tokenizer_class: str
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    add_bos_token: bool
    chat_template: str | None = None
    model_max_length: int
    vocab_size: int


class Health(_Body):
    status: str


class Version(_Body):
    version: str


class SessionCreated(_Body):
    id: str
    object: Literal["session"]
    num_tokens: int


class SessionState(_Body):
    """A session as `GET /v1/sessions/{id}` and `rewind` show it."""

    id: str
    object: Literal["session"]
    status: str
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    token_ids: list[int]
    text: str
    generating: bool
    pinned: bool


class SessionUsage(_Body):
    prompt_tokens: int
    completion_tokens: int


class SessionGeneration(_Body):
    """One generation segment (streamed: `session.generation.chunk` events, then this)."""

    id: str
    object: Literal["session.generation"]
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    content: str | None = None  # with tools: the text without its calls
    tool_calls: list[dict[str, Any]] | None = None
    logprobs: CompletionLogprobs | None = None
    usage: SessionUsage
    children: list[Any] | None = None


class SessionAppended(_Body):
    id: str
    object: Literal["session"]
    appended_tokens: int
    num_tokens: int


class Sample(_Body):
    token_id: int
    text: str
    logprob: float


class SessionSamples(_Body):
    id: str
    object: Literal["session.samples"]
    samples: list[Sample]


class Deleted(_Body):
    id: str
    object: str
    deleted: bool


class ResponseObject(_Body):
    """OpenAI's response object (streamed: the Responses event stream)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    output_text: str
    usage: dict[str, Any] | None = None
    previous_response_id: str | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class InputItemList(_Body):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


# (method, path) -> (the 200 body's models (one of), whether it can stream as SSE).
RESPONSES: dict[tuple[str, str], tuple[tuple[type[BaseModel], ...], bool]] = {
    ("get", "/health"): ((Health,), False),
    ("get", "/version"): ((Version,), False),
    ("post", "/v1/completions"): ((Completion,), True),
    ("post", "/v1/chat/completions"): ((ChatCompletion,), True),
    ("get", "/v1/models"): ((ModelList,), False),
    ("post", "/tokenize"): ((Tokenized,), False),
    ("post", "/detokenize"): ((Detokenized,), False),
    ("get", "/tokenizer_info"): ((TokenizerInfo,), False),
    ("post", "/v1/sessions"): ((SessionCreated,), False),
    ("post", "/v1/sessions/{session_id}/generate"): ((SessionGeneration,), True),
    ("post", "/v1/sessions/{session_id}/append"): ((SessionAppended, SessionGeneration), True),
    ("post", "/v1/sessions/{session_id}/resample"): ((SessionSamples,), False),
    ("post", "/v1/sessions/{session_id}/rewind"): ((SessionState,), False),
    ("get", "/v1/sessions/{session_id}"): ((SessionState,), False),
    ("delete", "/v1/sessions/{session_id}"): ((Deleted,), False),
    ("post", "/v1/responses"): ((ResponseObject,), True),
    ("get", "/v1/responses/{response_id}"): ((ResponseObject,), False),
    ("delete", "/v1/responses/{response_id}"): ((Deleted,), False),
    ("get", "/v1/responses/{response_id}/input_items"): ((InputItemList,), False),
}
# Routes whose 200 is not JSON.
PLAIN_TEXT = {("get", "/metrics"): "Prometheus metrics in the text exposition format"}

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
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "integer", "null"]}}}}}


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
