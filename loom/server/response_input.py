"""Responses' request parts read into what a turn runs: `input` items as chat messages (the
conversation the chat template renders) and as the input items a stored response lists;
`text.format` as a constraint. A malformed item is a 400 naming its field."""

from __future__ import annotations

import uuid
from typing import Any

from loom.errors import InvalidRequestError
from loom.sampling_params import StructuredOutputsParams
from loom.server.protocol import CalledFunction, ChatMessage, ResponsesRequest, ToolCall

# A message's content parts that carry text (a previous output passed back holds
# "output_text" parts).
_TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    """A fresh id of a Responses object (`resp_...`, `msg_...`, `fc_...`)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="invalid_value")


def _text_of(content: Any, where: str) -> str:
    """A message item's content as text: a string, or text parts (others are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}]: only text parts ({', '.join(_TEXT_PARTS)}) are "
                       f"supported, got {kind!r}", f"{where}[{j}].type")
        texts.append(part["text"])
    return "".join(texts)


def _required_str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{where}.{key} is required (a string)", f"{where}.{key}")
    return value


def _reasoning_item(item: dict[str, Any], where: str) -> tuple[str | None, dict[str, Any]]:
    """A reasoning item's text (its `reasoning_text` parts, else its summary's) and the
    input item kept of it (an `encrypted_content` is dropped: nothing here made it)."""
    parts: dict[str, Any] = {}
    for key, part_type in (("summary", "summary_text"), ("content", "reasoning_text")):
        value = item.get(key)
        if value is None and key == "content":
            continue
        if not isinstance(value, list) or not all(
                isinstance(p, dict) and p.get("type") == part_type
                and isinstance(p.get("text"), str) for p in value):
            raise _bad(f"{where}.{key} must be a list of {part_type} parts", f"{where}.{key}")
        parts[key] = [{"type": part_type, "text": p["text"]} for p in value]
    texts = parts.get("content") or parts["summary"]
    entry = {"id": item.get("id") or new_id("rs"), "type": "reasoning", **parts,
             "status": "completed"}
    return "".join(p["text"] for p in texts) or None, entry


def input_messages(items: str | list[dict[str, Any]]) -> tuple[list[ChatMessage],
                                                                list[dict[str, Any]]]:
    """`input` as chat messages (function calls joined to the assistant message before
    them, outputs as `tool` messages, a reasoning item's text as the `reasoning_content` of
    the assistant message after it) and as the stored input items (with ids). A malformed
    item is a 400 naming its field (`input[2].call_id`)."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not items:
        raise _bad("input must not be empty", "input")
    messages: list[ChatMessage] = []
    stored: list[dict[str, Any]] = []
    thought: str | None = None  # a reasoning item's text, for the next assistant message
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role must be user, system, developer or assistant, "
                           f"got {role!r}", f"{where}.role")
            text = _text_of(item.get("content"), f"{where}.content")
            messages.append(ChatMessage(role="system" if role == "developer" else role,
                                        content=text))
            if role == "assistant":
                messages[-1].reasoning_content = thought
            thought = None
            part = "output_text" if role == "assistant" else "input_text"
            stored.append({"id": item.get("id") or new_id("msg"), "type": "message",
                           "role": role, "status": "completed",
                           "content": [{"type": part, "text": text}]})
        elif kind == "function_call":
            call = ToolCall(id=_required_str(item, "call_id", where), function=CalledFunction(
                name=_required_str(item, "name", where),
                arguments=_required_str(item, "arguments", where)))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
                last.reasoning_content = last.reasoning_content or thought
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call],
                                            reasoning_content=thought))
            thought = None
            stored.append({"id": item.get("id") or new_id("fc"), "type": "function_call",
                           "call_id": call.id, "name": call.function.name,
                           "arguments": call.function.arguments, "status": "completed"})
        elif kind == "function_call_output":
            call_id = _required_str(item, "call_id", where)
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            messages.append(ChatMessage(role="tool", tool_call_id=call_id, content=text))
            thought = None
            stored.append({"id": item.get("id") or new_id("fco"),
                           "type": "function_call_output", "call_id": call_id,
                           "output": text, "status": "completed"})
        elif kind == "reasoning":
            thought, entry = _reasoning_item(item, where)
            stored.append(entry)
        else:
            raise _bad(f"{where}.type {kind!r} is not supported (message, function_call, "
                       "function_call_output, reasoning)", f"{where}.type")
    return messages, stored


def text_constraint(body: ResponsesRequest) -> StructuredOutputsParams | None:
    """The constraint `text.format` asks for (None: free text)."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.schema_ is None:
        raise _bad("text.format of type 'json_schema' needs schema (a JSON schema object)",
                   "text.format.schema")
    return StructuredOutputsParams(json=fmt.schema_)
