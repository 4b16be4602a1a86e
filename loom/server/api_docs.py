"""What `/openapi.json` says each route takes and answers: request bodies with the rules the
server checks beyond each field's type (exactly one of two fields, limits of the served
model and the flags), its 200 body (a schema per route, and the event stream where a route
streams), its error statuses with OpenAI's error body, and no 422 (a malformed body is a 400
naming the field).

The response models below document; the routes build their bodies as dicts and nothing
validates them at run time (the schema-driven test checks real answers against these
schemas). Fields a body carries only sometimes are optional; objects allow fields not named
here (OpenAI's shapes grow), so a client generated from the schema reads every answer.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from loom.server import protocol
from loom.server.protocol import LIMIT


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int | None = None


class CompletionLogprobs(_Body):
    tokens: list[str]
    # A logprob of -inf (a token a constraint forbids) is null in JSON.
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None] | None]
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
    logprob: float | None  # null: -inf


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
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]},
                   "code": {"type": "string"}}}}}


# ---- request bodies: what the server checks beyond each field's type ----------------------


def _given(field: str) -> dict[str, Any]:
    """The field is present and not null."""
    return {"required": [field], "properties": {field: {"not": {"type": "null"}}}}


def _exactly_one(first: str, second: str) -> dict[str, Any]:
    """Exactly one of two fields is given (null counts as not given)."""
    return {"oneOf": [_given(first), _given(second)]}


def _unless_empty(field: str, then: dict[str, Any]) -> dict[str, Any]:
    """`then` holds unless the field (a list) is missing, null or empty."""
    return {"anyOf": [{"properties": {field: {"anyOf": [
        {"type": "null"}, {"type": "array", "maxItems": 0}]}}}, then]}


def _null_or(schema: dict[str, Any]) -> dict[str, Any]:
    """Null, or what `schema` allows."""
    return {"anyOf": [{"type": "null"}, schema]}


# A forcing or "auto" tool_choice needs at least one tool (tools.plan_tools).
_TOOL_CHOICE_NEEDS_TOOLS = {"anyOf": [
    {"properties": {"tool_choice": _null_or({"const": "none"})}},
    {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}]}
_UNFORCED = {"properties": {"tool_choice": _null_or({"enum": ["none", "auto"]})}}
_TEXT_FORMAT = _null_or({"properties": {"type": {"const": "text"}}})
# One constraint at most: response_format or structured_outputs, or a forced tool call
# (constraints.requested_constraint, tools.plan_tools).
_ONE_CONSTRAINT = [
    {"anyOf": [{"properties": {"structured_outputs": {"type": "null"}}},
               {"properties": {"response_format": _TEXT_FORMAT}}]},
    {"anyOf": [_UNFORCED, {"properties": {"structured_outputs": {"type": "null"},
                                          "response_format": _TEXT_FORMAT}}]}]
# Tools are rendered with messages, never with a prompt (ServerState.prompt_or_messages).
_TOOLS_NEED_MESSAGES = _unless_empty("tools", _given("messages"))
# A session generates one sequence (SessionService.segment).
_ONE_SEQUENCE = {"properties": {"n": {"maximum": 1}}}

# Responses' input items as the response service reads them (response_service.input_messages).
_TEXT_PARTS = {"type": "array", "items": {
    "type": "object", "required": ["type", "text"],
    "properties": {"type": {"enum": ["input_text", "output_text", "text"]},
                   "text": {"type": "string"}}}}
_RESPONSE_CONTENT = {"anyOf": [{"type": "string"}, _TEXT_PARTS]}
_RESPONSE_INPUT_ITEM = {"type": "object", "oneOf": [
    {"required": ["role", "content"], "properties": {
        "type": {"const": "message"},
        "role": {"enum": ["user", "system", "developer", "assistant"]},
        "content": _RESPONSE_CONTENT}},
    {"required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"const": "function_call"}, "call_id": {"type": "string"},
        "name": {"type": "string"}, "arguments": {"type": "string"}}},
    {"required": ["type", "call_id", "output"], "properties": {
        "type": {"const": "function_call_output"}, "call_id": {"type": "string"},
        "output": _RESPONSE_CONTENT}}]}

# Rules each request body's schema adds (in `allOf`) to its fields' own.
REQUEST_RULES: dict[type[BaseModel], list[dict[str, Any]]] = {
    protocol.CompletionRequest: [*_ONE_CONSTRAINT, {"anyOf": [  # 0: scores an echoed prompt
        {"properties": {"max_tokens": {"not": {"const": 0}}}},
        {"required": ["echo"], "properties": {"echo": {"const": True}}}]}],
    protocol.ChatCompletionRequest: [_TOOL_CHOICE_NEEDS_TOOLS, *_ONE_CONSTRAINT],
    protocol.TokenizeRequest: [_exactly_one("prompt", "messages"), _TOOLS_NEED_MESSAGES],
    protocol.SessionCreateRequest: [_exactly_one("prompt", "messages"), _TOOLS_NEED_MESSAGES],
    protocol.SessionGenerateRequest: [_TOOL_CHOICE_NEEDS_TOOLS, *_ONE_CONSTRAINT,
                                      _ONE_SEQUENCE],
    protocol.SessionAppendRequest: [
        _TOOL_CHOICE_NEEDS_TOOLS, *_ONE_CONSTRAINT, _ONE_SEQUENCE,
        _exactly_one("text", "token_ids"),
        {"anyOf": [{"properties": {"heal": {"const": False}}}, _given("text")]}],  # heals text
    # A resample draws one token: min_tokens above 1 cannot be met.
    protocol.SessionResampleRequest: [{"properties": {"min_tokens": {"maximum": 1}}}],
    protocol.ResponsesRequest: [
        _TOOL_CHOICE_NEEDS_TOOLS,
        {"anyOf": [_UNFORCED, {"properties": {"text": _null_or(
            {"properties": {"format": _TEXT_FORMAT}})}}]},
        {"properties": {"input": {"anyOf": [
            {"type": "string"}, {"type": "array", "minItems": 1,
                                 "items": _RESPONSE_INPUT_ITEM}]}}}],
    # json_schema needs its schema (constraints.requested_constraint, text_constraint).
    protocol.ResponseFormat: [{"anyOf": [
        {"properties": {"type": {"enum": ["text", "json_object"]}}},
        {"required": ["json_schema"], "properties": {"json_schema": {
            "type": "object", "required": ["schema"],
            "properties": {"schema": {"type": "object"}}}}}]}],
    protocol.ResponseTextFormat: [{"anyOf": [
        {"properties": {"type": {"enum": ["text", "json_object"]}}},
        {"required": ["schema"], "properties": {"schema": {"type": "object"}}}]}],
    # Exactly one constraint (StructuredOutputsParams).
    protocol.StructuredOutputsField: [{"oneOf": [
        _given("json"), _given("regex"), _given("grammar"), _given("choice"),
        {"required": ["json_object"], "properties": {"json_object": {"const": True}}}]}],
}


def _at_most(limit: int) -> str:
    """A regex of the decimal numbers 0..limit (leading zeros allowed, as `int` reads them):
    fewer digits than `limit`, or as many and below it from some digit on, or `limit`."""
    digits = str(limit)
    options = [f"[0-9]{{1,{len(digits) - 1}}}"] if len(digits) > 1 else []
    for i, digit in enumerate(digits):
        if digit != "0":
            rest = len(digits) - i - 1
            options.append(f"{digits[:i]}[0-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest
                                                                   else ""))
    options.append(digits)
    return f"^\\s*0*({'|'.join(options)})\\s*$"


def _limits(state: Any) -> dict[str, dict[str, Any]]:
    """What each kind of `protocol.LIMIT` stands for on this server."""
    max_tokens = state.max_model_len - 1  # a prompt has a token at least
    if state.config.max_tokens_cap is not None:
        max_tokens = min(max_tokens, state.config.max_tokens_cap)
    last_id = state.engine.inputs.vocab_size - 1
    return {"token_id": {"maximum": last_id},
            "token_id_key": {"pattern": _at_most(last_id)},
            "max_tokens": {"maximum": max_tokens},
            "context": {"maximum": state.max_model_len - 1},
            "model": {"enum": [state.config.served_model_name]}}


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _fill_limits(node: Any, limits: dict[str, dict[str, Any]]) -> None:
    """Replace every `protocol.LIMIT` mark under `node` by the limit it names, and write an
    integer's bounds as integers (pydantic writes floats, which generators round: 2**63)."""
    if isinstance(node, dict):
        kind = node.pop(LIMIT, None)
        if kind is not None:
            node.update(limits[kind])
        if node.get("type") == "integer":
            for bound in _BOUNDS:
                if isinstance(node.get(bound), float) and node[bound].is_integer():
                    node[bound] = int(node[bound])
        for child in node.values():
            _fill_limits(child, limits)
    elif isinstance(node, list):
        for child in node:
            _fill_limits(child, limits)


def _document_requests(schemas: dict[str, Any], state: Any) -> None:
    """Add REQUEST_RULES and this server's limits to the request bodies' schemas."""
    for model, rules in REQUEST_RULES.items():
        schema = schemas.get(model.__name__)
        if schema is not None:
            schema["allOf"] = [*schema.get("allOf", []), *copy.deepcopy(rules)]
    _fill_limits(schemas, _limits(state))


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
        _document_requests(schemas, app.state.loom)
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
