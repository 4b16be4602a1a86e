"""OpenAI's Responses API on live sessions: each response is a session, and a response that
names `previous_response_id` continues the session of that response.

One mechanism serves every turn. The whole conversation (the previous response's messages,
its output, the new input items; this request's `instructions` first) is rendered by the
chat template, as chat completions would render it. The previous response's session is
forked at the longest common token prefix of its tokens and the rendered ones (sharing its
blocks copy-on-write: two responses continuing the same one do not disturb each other), and
only the difference is appended and computed before generating. A response whose output
followed a grammar (a forced tool call, `text.format`) is not forked, since a fork would
carry the grammar's state into the next turn (`StoredResponse.forkable`): its continuation
opens a session of its own over the conversation, served by the prefix cache. A template
that renders earlier turns differently once more turns follow (or the closing tokens of a
turn cut by `max_output_tokens`) only moves the common prefix back. Where the previous
session is gone (its time to live passed, the server restarted, a delete raced the
continuation), the conversation is computed afresh from its rendered tokens (the prefix
cache or the KV store may still hold them): the same tokens, since a token's logits do not
depend on how its context reached the cache.

This module knows no transport: `ResponseService.start` checks a request and starts its
session, and a `ResponseTurn` yields the Responses API's events (plain dicts, the last one
carrying the whole response); the HTTP routes (`response_routes.py`) send them as SSE or
return the final response.

Memory: a stored response keeps its session paused under the engine's policy (least
recently used idle sessions are evicted, and recomputed when used, when the KV pool is
needed; `response_ttl_s` closes them) and its messages in a store bounded by count;
`store=false` keeps nothing once the response is done. With a KV store configured
(`--kv-transfer-config`), every finished stored response is also kept there beside the
blocks: one evicted from memory, or stored before a restart, is read back on use.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from loom.engine.session_store import SessionStore
from loom.engine.sessions import common_prefix
from loom.errors import InvalidRequestError, LoomError, UnknownRequestError
from loom.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from loom.server import tool_calls
from loom.server.constraints import constrain
from loom.server.errors import APIError, as_api_error
from loom.server.protocol import (
    CalledFunction,
    ChatMessage,
    ResponsesRequest,
    ToolCall,
)
from loom.server.state import ServerState, key_digest
from loom.server.tool_calls import ParsedCall
from loom.server.tools import ToolPlan, plan_tools

logger = logging.getLogger(__name__)

# The kind of record a finished response is kept as in a KV store.
_RESPONSE_RECORD = "response"

# A message's content parts that carry text (a previous output passed back holds
# "output_text" parts).
_TEXT_PARTS = ("input_text", "output_text", "text")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


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


def input_messages(items: str | list[dict[str, Any]]) -> tuple[list[ChatMessage],
                                                                list[dict[str, Any]]]:
    """`input` as chat messages (function calls joined to the assistant message before
    them, outputs as `tool` messages) and as the stored input items (with ids). A malformed
    item is a 400 naming its field (`input[2].call_id`)."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not items:
        raise _bad("input must not be empty", "input")
    messages: list[ChatMessage] = []
    stored: list[dict[str, Any]] = []
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
            part = "output_text" if role == "assistant" else "input_text"
            stored.append({"id": item.get("id") or _new_id("msg"), "type": "message",
                           "role": role, "status": "completed",
                           "content": [{"type": part, "text": text}]})
        elif kind == "function_call":
            call = ToolCall(id=_required_str(item, "call_id", where), function=CalledFunction(
                name=_required_str(item, "name", where),
                arguments=_required_str(item, "arguments", where)))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            stored.append({"id": item.get("id") or _new_id("fc"), "type": "function_call",
                           "call_id": call.id, "name": call.function.name,
                           "arguments": call.function.arguments, "status": "completed"})
        elif kind == "function_call_output":
            call_id = _required_str(item, "call_id", where)
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            messages.append(ChatMessage(role="tool", tool_call_id=call_id, content=text))
            stored.append({"id": item.get("id") or _new_id("fco"),
                           "type": "function_call_output", "call_id": call_id,
                           "output": text, "status": "completed"})
        else:
            raise _bad(f"{where}.type {kind!r} is not supported (message, function_call, "
                       "function_call_output)", f"{where}.type")
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


@dataclass
class StoredResponse:
    """A response the store keeps: its latest body, its conversation after the turn (the
    messages the next turn renders, without instructions), its input items."""

    id: str
    owner: str
    body: dict[str, Any]
    messages: list[ChatMessage]
    input_items: list[dict[str, Any]]

    @property
    def status(self) -> str:
        """in_progress, completed, incomplete."""
        return str(self.body["status"])

    @property
    def forkable(self) -> bool:
        """Whether a continuation may fork this response's session. Not when its output
        followed a grammar (a forced tool call, `text.format`): the session keeps the
        grammar's state and a fork carries it, cut back to the fork's length, so that a next
        turn under the same constraint would go on with that document instead of starting
        its own (and a cut across a finished document does not even land where it should).
        Such a continuation opens a session of its own; the prefix cache still serves the
        blocks it shares with this one."""
        body = self.body
        forced = bool(body.get("tools")) and body.get("tool_choice") not in (None, "auto",
                                                                            "none")
        fmt = (body.get("text") or {}).get("format") or {}
        return not forced and fmt.get("type", "text") == "text"

    def to_bytes(self) -> bytes:
        """The finished response as JSON for a store (its owner as a digest of the key)."""
        return json.dumps({
            "id": self.id, "owner": key_digest(self.owner).decode(), "body": self.body,
            "messages": [m.model_dump(exclude_none=True) for m in self.messages],
            "input_items": self.input_items}).encode()

    @classmethod
    def from_bytes(cls, data: bytes, owner: str) -> StoredResponse | None:
        """A stored response read back for `owner`; None when it is another key's or the
        bytes are not one (logged)."""
        try:
            record = json.loads(data)
            if record["owner"] != key_digest(owner).decode():
                return None
            return cls(str(record["id"]), owner, record["body"],
                       [ChatMessage.model_validate(m) for m in record["messages"]],
                       list(record["input_items"]))
        except (ValueError, KeyError, TypeError) as error:
            logger.warning("a stored response cannot be read: %s", error)
            return None


class ResponseStore:
    """Stored responses by id, least recently used first, at most `max_entries` in memory
    (the oldest finished one goes, and its session with it). With a KV store (`kept`), every
    finished response is also kept there: one evicted from memory, or stored before a
    restart, is read back on use and its conversation continues (its blocks loaded from the
    store)."""

    def __init__(self, max_entries: int, kept: SessionStore | None = None) -> None:
        self.max_entries = max_entries
        self.kept = kept
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str, owner: str, param: str | None = None) -> StoredResponse:
        """The response, most recently used now; a 404 naming it when it is unknown, deleted
        or another key's."""
        entry = self._entries.get(response_id)
        if entry is None and self.kept is not None:
            data = self.kept.get_record(_RESPONSE_RECORD, response_id)
            entry = None if data is None else StoredResponse.from_bytes(data, owner)
            if entry is not None and entry.id == response_id:
                self._entries[response_id] = entry
        if entry is None or entry.owner != owner:
            what = "previous response" if param == "previous_response_id" else "response"
            raise APIError(404, f"{what} {response_id!r} not found", param=param,
                           code="response_not_found")
        self._entries.move_to_end(response_id)
        return entry

    def put(self, entry: StoredResponse) -> list[str]:
        """Store (or refresh) a response; returns the ids evicted from memory to stay within
        bounds (a finished one stays in the KV store, where there is one)."""
        self._entries[entry.id] = entry
        if self.kept is not None and entry.status != "in_progress":
            self.kept.put_record(_RESPONSE_RECORD, entry.id, entry.to_bytes())
        self._entries.move_to_end(entry.id)
        evicted = []
        for rid in list(self._entries):
            if len(self._entries) <= self.max_entries:
                break
            if self._entries[rid].status != "in_progress":
                del self._entries[rid]
                evicted.append(rid)
        return evicted

    def ids(self) -> list[str]:
        """The stored responses' ids, least recently used first."""
        return list(self._entries)

    def pop(self, response_id: str) -> StoredResponse | None:
        """Forget a response (in the KV store too)."""
        if self.kept is not None:
            self.kept.delete_record(_RESPONSE_RECORD, response_id)
        return self._entries.pop(response_id, None)


@dataclass
class ResponseTurn:
    """One response under way: its session generates; `events()` yields the Responses
    API's events, the last one the whole response."""

    service: ResponseService
    body: ResponsesRequest
    response_id: str
    owner: str
    prompt_ids: list[int]
    messages: list[ChatMessage]
    input_items: list[dict[str, Any]]
    tools: ToolPlan
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = field(default_factory=list)
    _sequence: int = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def response(self, status: str, usage: dict[str, Any] | None = None,
                 incomplete: str | None = None,
                 error: APIError | None = None) -> dict[str, Any]:
        """The response object as it stands (`error`: why it failed)."""
        body = self.body
        fmt = body.text.format if body.text is not None and body.text.format else None
        text_format = fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {
            "type": "text"}
        choice = body.tool_choice
        texts = [part["text"] for item in self.output if item["type"] == "message"
                 for part in item["content"] if part["type"] == "output_text"]
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": status, "background": False,
            "error": None if error is None else {"code": str(error.code or error.status),
                                                 "message": error.message},
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.service.state.config.served_model_name,
            "output": [dict(item) for item in self.output], "output_text": "".join(texts),
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": text_format},
            "tool_choice": choice.model_dump() if hasattr(choice, "model_dump")
            else (choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
            "usage": usage, "metadata": body.metadata or {}, "user": None,
        }

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The turn's events as it generates, the last one `response.completed` or
        `response.incomplete`; whatever ends the iteration early stops the generation and
        forgets the response (closing its session). A turn that fails raises its APIError,
        or, streamed (its headers are out), ends with `response.failed` naming it."""
        try:
            async for event in self._generate():
                yield event
        except Exception as error:
            failure = as_api_error(error)
            if not self.body.stream:
                raise failure from None
            logger.warning("response %s failed: %s", self.response_id, failure.message)
            yield self._event("response.failed",
                              response=self.response("failed", error=failure))

    async def _generate(self) -> AsyncIterator[dict[str, Any]]:
        """The events of `events`, failures raised."""
        engine = self.service.state.engine
        done = False
        try:
            yield self._event("response.created", response=self.response("in_progress"))
            yield self._event("response.in_progress", response=self.response("in_progress"))
            names = self.tools.names if self.tools.parses else None
            parser = tool_calls.ToolCallParser(names) if names else None
            message: dict[str, Any] | None = None  # the message item being written
            generated, reason = 0, None

            def open_message() -> list[dict[str, Any]]:
                nonlocal message
                message = {"id": _new_id("msg"), "type": "message", "status": "in_progress",
                           "role": "assistant", "content": []}
                self.output.append(message)
                index = len(self.output) - 1
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                message["content"].append(part)
                return [self._event("response.output_item.added", output_index=index,
                                    item={**message, "content": []}),
                        self._event("response.content_part.added", item_id=message["id"],
                                    output_index=index, content_index=0, part=dict(part))]

            def close_message() -> list[dict[str, Any]]:
                nonlocal message
                if message is None:
                    return []
                index, part = self.output.index(message), message["content"][0]
                message["status"] = "completed"
                events = [
                    self._event("response.output_text.done", item_id=message["id"],
                                output_index=index, content_index=0, text=part["text"],
                                logprobs=[]),
                    self._event("response.content_part.done", item_id=message["id"],
                                output_index=index, content_index=0, part=dict(part)),
                    self._event("response.output_item.done", output_index=index,
                                item=dict(message))]
                message = None
                return events

            def text_events(text: str) -> list[dict[str, Any]]:
                events = open_message() if message is None else []
                assert message is not None
                message["content"][0]["text"] += text
                events.append(self._event(
                    "response.output_text.delta", item_id=message["id"],
                    output_index=self.output.index(message), content_index=0, delta=text,
                    logprobs=[]))
                return events

            def call_events(call: ParsedCall) -> list[dict[str, Any]]:
                events = close_message()
                item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress",
                        "call_id": call.id, "name": call.name, "arguments": ""}
                self.output.append(item)
                index = len(self.output) - 1
                events.append(self._event("response.output_item.added", output_index=index,
                                          item=dict(item)))
                events.append(self._event("response.function_call_arguments.delta",
                                          item_id=item["id"], output_index=index,
                                          delta=call.arguments))
                item["arguments"], item["status"] = call.arguments, "completed"
                events.append(self._event("response.function_call_arguments.done",
                                          item_id=item["id"], output_index=index,
                                          name=call.name, arguments=call.arguments))
                events.append(self._event("response.output_item.done", output_index=index,
                                          item=dict(item)))
                return events

            def pieces_events(pieces: list[str | ParsedCall]) -> list[dict[str, Any]]:
                events: list[dict[str, Any]] = []
                for piece in pieces:
                    events += text_events(piece) if isinstance(piece, str) \
                        else call_events(piece)
                return events

            async for out in engine.outputs(self.response_id):
                if out.error is not None:
                    raise APIError(503, out.error, code="request_failed")
                comp = out.outputs[0]
                generated += len(comp.token_ids)
                finished = comp.finish_reason is not None
                if comp.text:
                    for event in pieces_events(parser.feed(comp.text) if parser
                                               else [comp.text]):
                        yield event
                if finished:
                    reason = comp.finish_reason
                    if parser is not None:
                        for event in pieces_events(parser.finish()):
                            yield event
                    break
            for event in close_message():
                yield event
            view = await engine.get_session(self.response_id)
            usage = {"input_tokens": len(self.prompt_ids),
                     "input_tokens_details": {"cached_tokens": view.num_cached_tokens},
                     "output_tokens": generated,
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": len(self.prompt_ids) + generated}
            incomplete = "max_output_tokens" if reason == "length" else None
            status = "incomplete" if incomplete else "completed"
            final = self.response(status, usage, incomplete)
            done = True
            await self.service.finish(self, final)
            yield self._event(f"response.{status}", response=final)
        finally:
            if not done:
                await self.service.abandon(self)

    def assistant_message(self) -> ChatMessage:
        """This turn's output as the assistant message the next turn renders."""
        text = "".join(part["text"] for item in self.output if item["type"] == "message"
                       for part in item["content"])
        calls = [ToolCall(id=item["call_id"], function=CalledFunction(
            name=item["name"], arguments=item["arguments"]))
            for item in self.output if item["type"] == "function_call"]
        return ChatMessage(role="assistant", content=text or (None if calls else ""),
                           tool_calls=calls or None)


class ResponseService:
    """Responses over the engine's sessions: start a turn, finish or abandon it, and the
    stored responses' reads and deletes. One per server."""

    def __init__(self, state: ServerState, ttl_s: float | None, max_stored: int) -> None:
        self.state = state
        self.ttl_s = ttl_s
        self.store = ResponseStore(max_stored, state.engine.session_store)

    async def start(self, body: ResponsesRequest, owner: str) -> ResponseTurn:
        """Check the request, render the conversation, and start its session generating
        (continuing the previous response's session where it is live). Every refusal comes
        before anything is opened or appended."""
        state = self.state
        state.check_model(body.model)
        previous = None
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id, owner, "previous_response_id")
            if previous.status == "in_progress":
                raise APIError(409, f"previous response {previous.id!r} is still in progress",
                               param="previous_response_id", code="response_in_progress")
        new_messages, items = input_messages(body.input)
        history = [*(previous.messages if previous else []), *new_messages]
        rendered = [ChatMessage(role="system", content=body.instructions), *history] \
            if body.instructions else history
        constraint = text_constraint(body)
        tools = plan_tools(body.chat_tools(), constrained=constraint is not None)
        ids = state.chat_ids(rendered, True, tools if tools.offered else None)
        limit = state.max_tokens(body.max_output_tokens, len(ids))
        params = await constrain(state, body.sampling_params(limit), constraint, "text.format",
                                 tools)
        params = params.with_updates(output_kind=RequestOutputKind.DELTA)
        turn = ResponseTurn(self, body, _new_id("resp"), owner, ids, history, items, tools)
        await self._open_session(turn, previous, params)
        if body.store:
            await self._evict(self.store.put(StoredResponse(
                turn.response_id, owner, turn.response("in_progress"), history, items)))
        return turn

    async def _open_session(self, turn: ResponseTurn, previous: StoredResponse | None,
                            params: SamplingParams) -> None:
        """Fork the previous response's session at the common prefix and append the rest;
        else (no previous one, or its session is gone) open a session over every token."""
        if previous is not None and previous.forkable \
                and await self._fork(turn, previous, params):
            return
        engine, ids, rid = self.state.engine, turn.prompt_ids, turn.response_id
        try:
            await engine.add_request(rid, ids, params, session=True, ttl_s=self.ttl_s)
        except LoomError as error:
            raise APIError(400, str(error), param="input") from None

    async def _fork(self, turn: ResponseTurn, previous: StoredResponse,
                    params: SamplingParams) -> bool:
        """Fork `previous`'s session into the turn's and start it generating after the rest
        of its tokens; False (nothing opened) when there is nothing to share: the session is
        gone (expired, evicted, deleted meanwhile: each engine call may find it so) or has
        no block to spare for the copy."""
        engine, ids, rid = self.state.engine, turn.prompt_ids, turn.response_id
        if not engine.is_live(previous.id):  # not restored from a store just to be forked
            return False
        try:
            view = await engine.get_session(previous.id)
        except UnknownRequestError:
            return False
        keep = common_prefix(view.token_ids, ids)
        # A response's session never generates again once its turn is over (a continuation
        # forks it); `generating` here is a turn still finishing.
        if keep == 0 or view.generating:
            return False
        try:
            await engine.fork_session(previous.id, rid, keep, ttl_s=self.ttl_s)
        except (InvalidRequestError, UnknownRequestError):
            return False
        try:
            await engine.start_segment(rid, lambda _: params, ids[keep:] or None)
        except BaseException:
            await asyncio.shield(self._close(rid))
            raise
        return True

    async def finish(self, turn: ResponseTurn, final: dict[str, Any]) -> None:
        """The turn ended: store its response and conversation (its session stays paused
        for the next turn), or with `store=false` close its session."""
        if not turn.body.store:
            await self._close(turn.response_id)
            return
        messages = [*turn.messages, turn.assistant_message()]
        await self._evict(self.store.put(StoredResponse(turn.response_id, turn.owner, final,
                                                        messages, turn.input_items)))

    async def abandon(self, turn: ResponseTurn) -> None:
        """The turn did not finish (its client left, the engine failed): forget it."""
        self.store.pop(turn.response_id)
        await asyncio.shield(self._close(turn.response_id))

    def get(self, response_id: str, owner: str) -> dict[str, Any]:
        """A stored response's body."""
        return self.store.get(response_id, owner).body

    async def delete(self, response_id: str, owner: str) -> None:
        """Forget a stored response and close its session (a 409 while it generates)."""
        entry = self.store.get(response_id, owner)
        if entry.status == "in_progress":
            raise APIError(409, f"response {response_id!r} is still in progress",
                           code="response_in_progress")
        self.store.pop(response_id)
        await self._close(response_id)

    def input_items(self, response_id: str, owner: str, order: str, limit: int,
                    after: str | None) -> dict[str, Any]:
        """A page of a stored response's input items (OpenAI's list shape)."""
        items = list(self.store.get(response_id, owner).input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(400, f"after={after!r} is not an input item of this response",
                               param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit}

    async def _evict(self, response_ids: list[str]) -> None:
        for rid in response_ids:
            await self._close(rid)

    async def _close(self, session_id: str) -> None:
        engine = self.state.engine
        if engine.is_live(session_id):
            with contextlib.suppress(LoomError):
                await engine.close(session_id)
