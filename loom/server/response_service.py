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

This module knows no transport: `ResponseService.start` checks a request (its input items
read by `response_input.py`) and starts its session, and a `ResponseTurn`
(`response_turn.py`) yields the Responses API's events (plain dicts, the last one carrying
the whole response); the HTTP routes (`response_routes.py`) send them as SSE or return the
final response. Stored responses are `response_store.py`'s.

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
from typing import Any

from loom.engine.sessions import common_prefix
from loom.errors import (
    InvalidRequestError,
    InvalidSessionStateError,
    LoomError,
    UnknownRequestError,
)
from loom.sampling_params import RequestOutputKind, SamplingParams
from loom.server.constraints import constrain_chat
from loom.server.protocol import ChatMessage, ResponsesRequest
from loom.server.response_input import input_messages, new_id, text_constraint
from loom.server.response_store import ResponseStore, StoredResponse
from loom.server.response_turn import ResponseTurn
from loom.server.state import ServerState
from loom.server.tools import plan_tools


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
                raise InvalidSessionStateError(
                    f"previous response {previous.id!r} is still in progress",
                    param="previous_response_id", code="response_in_progress")
        new_messages, items = input_messages(body.input)
        history = [*(previous.messages if previous else []), *new_messages]
        rendered = [ChatMessage(role="system", content=body.instructions), *history] \
            if body.instructions else history
        constraint = text_constraint(body)
        tools = plan_tools(body.chat_tools(), constrained=constraint is not None)
        effort = body.reasoning.effort if body.reasoning is not None else None
        ids = state.chat_ids(rendered, True, tools if tools.offered else None,
                             reasoning_effort=effort)
        limit = state.max_tokens(body.max_output_tokens, len(ids))
        params = await constrain_chat(state, body.sampling_params(limit), constraint,
                                      "text.format", tools)
        params = params.with_updates(output_kind=RequestOutputKind.DELTA)
        split = state.output_split(ids, params.structured_outputs is not None,
                                   tools.names if tools.parses else None)
        turn = ResponseTurn(self, body, new_id("resp"), owner, ids, history, items, tools,
                            split)
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
            raise InvalidRequestError(str(error), param="input",
                                      code="invalid_request") from None

    async def _fork(self, turn: ResponseTurn, previous: StoredResponse,
                    params: SamplingParams) -> bool:
        """Fork `previous`'s session into the turn's and start it generating after the rest
        of its tokens; False (nothing opened) when there is nothing to share: the session is
        gone (expired, evicted, deleted meanwhile: each engine call may find it so) or has
        no block to spare for the copy."""
        engine, ids, rid = self.state.engine, turn.prompt_ids, turn.response_id
        if not await engine.holds(previous.id):  # not restored from a store to be forked
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
            await engine.start_segment(rid, params, ids[keep:] or None)
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
        """Forget a stored response and close its session (InvalidSessionStateError while it
        generates)."""
        entry = self.store.get(response_id, owner)
        if entry.status == "in_progress":
            raise InvalidSessionStateError(f"response {response_id!r} is still in progress",
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
                raise InvalidRequestError(
                    f"after={after!r} is not an input item of this response", param="after",
                    code="invalid_request")
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
        with contextlib.suppress(LoomError):
            if await engine.holds(session_id):
                await engine.close(session_id)
