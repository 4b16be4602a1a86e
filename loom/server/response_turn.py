"""One Responses turn under way: its session generates and `ResponseTurn.events()` yields
the Responses API's events (plain dicts: the output items and their text and call deltas,
the last one carrying the whole response). The turn knows no transport, and tells its host
(the response service) how it ended: finished (stored or closed) or abandoned.

The output is split by its format (`output_split.py`): a thinking model's reasoning (think
tags, or a harmony model's analysis channel) is a `reasoning` item (its text a
`reasoning_text` content part) before the message and calls, which are read from the answer
only. The conversation the next turn renders keeps the output as the format has it (a think
block as generated: the session's tokens; a harmony turn's analysis as its reasoning), so a
continuation shares as much as the rendering allows."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from loom.errors import RequestFailedError
from loom.server.errors import APIError, as_api_error
from loom.server.output_split import OutputSplit, split_step
from loom.server.protocol import CalledFunction, ChatMessage, ResponsesRequest, ToolCall
from loom.server.response_input import new_id
from loom.server.state import ServerState
from loom.server.tool_calls import ParsedCall
from loom.server.tools import ToolPlan

logger = logging.getLogger(__name__)


class TurnHost(Protocol):
    """What a turn needs of the service that started it: the server's state, and hearing
    how the turn ended (exactly one of `finish` and `abandon` is called, once)."""

    state: ServerState

    async def finish(self, turn: ResponseTurn, final: dict[str, Any]) -> None:
        """The turn ended with `final`, the whole response."""

    async def abandon(self, turn: ResponseTurn) -> None:
        """The turn did not finish (its client left, the engine failed)."""


@dataclass
class ResponseTurn:
    """One response under way: its session generates; `events()` yields the Responses
    API's events, the last one the whole response."""

    service: TurnHost
    body: ResponsesRequest
    response_id: str
    owner: str
    prompt_ids: list[int]
    messages: list[ChatMessage]
    input_items: list[dict[str, Any]]
    tools: ToolPlan
    split: OutputSplit  # the output into reasoning, answer and calls
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
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                          "summary": None}, "store": body.store,
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
            message: dict[str, Any] | None = None  # the message item being written
            thought: dict[str, Any] | None = None  # the reasoning item being written
            generated, reason = 0, None

            def part_events(item: dict[str, Any], kind: str, opening: bool
                            ) -> list[dict[str, Any]]:
                """A one-part item's opening (`opening`) or closing events; `kind`: the
                part's text events' name (output_text, reasoning_text)."""
                index, part = self.output.index(item), item["content"][0]
                if opening:
                    return [self._event("response.output_item.added", output_index=index,
                                        item={**item, "content": []}),
                            self._event("response.content_part.added", item_id=item["id"],
                                        output_index=index, content_index=0,
                                        part=dict(part))]
                item["status"] = "completed"
                extra = {"logprobs": []} if kind == "output_text" else {}
                return [self._event(f"response.{kind}.done", item_id=item["id"],
                                    output_index=index, content_index=0, text=part["text"],
                                    **extra),
                        self._event("response.content_part.done", item_id=item["id"],
                                    output_index=index, content_index=0, part=dict(part)),
                        self._event("response.output_item.done", output_index=index,
                                    item=dict(item))]

            def reasoning_events(text: str) -> list[dict[str, Any]]:
                nonlocal thought
                events: list[dict[str, Any]] = []
                if thought is None:
                    thought = {"id": new_id("rs"), "type": "reasoning", "summary": [],
                               "content": [{"type": "reasoning_text", "text": ""}],
                               "status": "in_progress"}
                    self.output.append(thought)
                    events = part_events(thought, "reasoning_text", opening=True)
                thought["content"][0]["text"] += text
                events.append(self._event(
                    "response.reasoning_text.delta", item_id=thought["id"],
                    output_index=self.output.index(thought), content_index=0, delta=text))
                return events

            def close_reasoning() -> list[dict[str, Any]]:
                if thought is None or thought["status"] == "completed":
                    return []
                return part_events(thought, "reasoning_text", opening=False)

            def open_message() -> list[dict[str, Any]]:
                nonlocal message
                events = close_reasoning()
                message = {"id": new_id("msg"), "type": "message", "status": "in_progress",
                           "role": "assistant", "content": [
                               {"type": "output_text", "text": "", "annotations": [],
                                "logprobs": []}]}
                self.output.append(message)
                return events + part_events(message, "output_text", opening=True)

            def close_message() -> list[dict[str, Any]]:
                nonlocal message
                if message is None:
                    return close_reasoning()
                events = part_events(message, "output_text", opening=False)
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
                item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
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
                    raise RequestFailedError(out.error, code="request_failed")
                comp = out.outputs[0]
                generated += len(comp.token_ids)
                finished = comp.finish_reason is not None
                thinking, pieces = split_step(self.split, comp.text, comp.token_ids, finished)
                if thinking:
                    for event in reasoning_events(thinking):
                        yield event
                for event in pieces_events(pieces):
                    yield event
                if finished:
                    reason = comp.finish_reason
                    break
            for event in close_message():
                yield event
            view = await engine.get_session(self.response_id)
            thoughts = [part["text"] for item in self.output if item["type"] == "reasoning"
                        for part in item["content"]]
            usage = {"input_tokens": len(self.prompt_ids),
                     "input_tokens_details": {"cached_tokens": view.num_cached_tokens},
                     "output_tokens": generated,
                     "output_tokens_details": {
                         "reasoning_tokens": self.service.state.reasoning_tokens(thoughts) or 0},
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
        """This turn's output as the assistant message the next turn renders: its answer and
        reasoning as its format keeps them (`OutputSplit.history`), calls apart."""
        answer = "".join(part["text"] for item in self.output if item["type"] == "message"
                         for part in item["content"])
        text, reasoning = self.split.history(answer)
        calls = [ToolCall(id=item["call_id"], function=CalledFunction(
            name=item["name"], arguments=item["arguments"]))
            for item in self.output if item["type"] == "function_call"]
        return ChatMessage(role="assistant", content=text or (None if calls else ""),
                           tool_calls=calls or None, reasoning_content=reasoning)
