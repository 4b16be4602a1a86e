"""The rules `/openapi.json` adds to the request bodies' schemas: what the server checks
beyond each field's type (exactly one of two fields, a tool_choice needing tools, one
constraint, Responses input items), and this server's limits (the vocabulary, the
max_tokens cap, the context, the served model, the embedding sizes it allows) where a field
carries `request_base.LIMIT`.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

from loom.server.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)
from loom.server.request_base import LIMIT
from loom.server.request_fields import ResponseFormat, StructuredOutputsField
from loom.server.response_requests import ResponsesRequest, ResponseTextFormat
from loom.server.session_requests import (
    SessionAppendRequest,
    SessionCreateRequest,
    SessionGenerateRequest,
    SessionResampleRequest,
)


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

# Responses' input items as the response service reads them (response_input.input_messages).
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
    CompletionRequest: [*_ONE_CONSTRAINT, {"anyOf": [  # 0: scores an echoed prompt
        {"properties": {"max_tokens": {"not": {"const": 0}}}},
        {"required": ["echo"], "properties": {"echo": {"const": True}}}]}],
    ChatCompletionRequest: [_TOOL_CHOICE_NEEDS_TOOLS, *_ONE_CONSTRAINT],
    TokenizeRequest: [_exactly_one("prompt", "messages"), _TOOLS_NEED_MESSAGES],
    SessionCreateRequest: [_exactly_one("prompt", "messages"), _TOOLS_NEED_MESSAGES],
    SessionGenerateRequest: [_TOOL_CHOICE_NEEDS_TOOLS, *_ONE_CONSTRAINT, _ONE_SEQUENCE],
    SessionAppendRequest: [
        _TOOL_CHOICE_NEEDS_TOOLS, *_ONE_CONSTRAINT, _ONE_SEQUENCE,
        _exactly_one("text", "token_ids"),
        {"anyOf": [{"properties": {"heal": {"const": False}}}, _given("text")]}],  # heals text
    # A resample draws one token: min_tokens above 1 cannot be met.
    SessionResampleRequest: [{"properties": {"min_tokens": {"maximum": 1}}}],
    ResponsesRequest: [
        _TOOL_CHOICE_NEEDS_TOOLS,
        {"anyOf": [_UNFORCED, {"properties": {"text": _null_or(
            {"properties": {"format": _TEXT_FORMAT}})}}]},
        {"properties": {"input": {"anyOf": [
            {"type": "string"}, {"type": "array", "minItems": 1,
                                 "items": _RESPONSE_INPUT_ITEM}]}}}],
    # json_schema needs its schema (constraints.requested_constraint,
    # response_input.text_constraint).
    ResponseFormat: [{"anyOf": [
        {"properties": {"type": {"enum": ["text", "json_object"]}}},
        {"required": ["json_schema"], "properties": {"json_schema": {
            "type": "object", "required": ["schema"],
            "properties": {"schema": {"type": "object"}}}}}]}],
    ResponseTextFormat: [{"anyOf": [
        {"properties": {"type": {"enum": ["text", "json_object"]}}},
        {"required": ["schema"], "properties": {"schema": {"type": "object"}}}]}],
    # Exactly one constraint (StructuredOutputsParams).
    StructuredOutputsField: [{"oneOf": [
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
    """What each kind of `LIMIT` stands for on this server."""
    max_tokens = state.max_model_len - 1  # a prompt has a token at least
    if state.config.max_tokens_cap is not None:
        max_tokens = min(max_tokens, state.config.max_tokens_cap)
    last_id = state.engine.inputs.vocab_size - 1
    sizes = state.engine.embedding_dimensions()
    if sizes and sizes == list(range(1, len(sizes) + 1)):
        dimensions: dict[str, Any] = {"maximum": len(sizes)}
    else:  # none (maximum 0: no integer is allowed) or the model's list
        dimensions = {"enum": sizes} if sizes else {"maximum": 0}
    return {"token_id": {"maximum": last_id},
            "dimensions": dimensions,
            "token_id_key": {"pattern": _at_most(last_id)},
            "max_tokens": {"maximum": max_tokens},
            "context": {"maximum": state.max_model_len - 1},
            "model": {"enum": [state.config.served_model_name]}}


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _fill_limits(node: Any, limits: dict[str, dict[str, Any]]) -> None:
    """Replace every `LIMIT` mark under `node` by the limit it names, and write an
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


def document_requests(schemas: dict[str, Any], state: Any) -> None:
    """Add REQUEST_RULES and this server's limits to the request bodies' schemas."""
    for model, rules in REQUEST_RULES.items():
        schema = schemas.get(model.__name__)
        if schema is not None:
            schema["allOf"] = [*schema.get("allOf", []), *copy.deepcopy(rules)]
    _fill_limits(schemas, _limits(state))
