"""Live sessions for a server's clients, knowing no transport: open, append, generate,
resample, rewind, inspect, close, with ownership and quotas.

A session belongs to the API key that opened it; every operation checks the owner first
(another key gets the 404 an unknown id gets, so ids leak nothing), and with a KV store a
session kept across a restart is restored for its owner here. A generation segment is a
`SegmentRun`: its events are plain dicts (chunks as the segment generates, then the whole
segment), which the HTTP routes (`session_routes.py`: JSON or SSE) and the WebSocket
endpoint (`session_socket.py`) send as they do. Refusals are `LoomError`s (their kind by
class, with the field and a code), mapped to statuses by the adapters; they come before
anything is appended or started.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from loom.engine.outputs import OutputAccumulator, RequestOutput
from loom.engine.sessions import SessionView
from loom.errors import (
    InvalidRequestError,
    LoomError,
    QuotaExceededError,
    RequestFailedError,
    SessionLostError,
    UnknownRequestError,
)
from loom.sampling_params import RequestOutputKind
from loom.server import tool_calls
from loom.server.constraints import constrain, requested_constraint
from loom.server.protocol import (
    SessionAppendRequest,
    SessionCreateRequest,
    SessionGenerateRequest,
    SessionResampleRequest,
)
from loom.server.responses import completion_logprobs, request_tree
from loom.server.state import ServerState
from loom.server.tools import plan_tools


def session_view(view: SessionView) -> dict[str, Any]:
    """A session as the API shows it."""
    return {"id": view.request_id, "object": "session", "status": view.status,
            "num_tokens": len(view.token_ids), "num_prompt_tokens": view.num_prompt_tokens,
            "num_computed_tokens": view.num_computed_tokens, "token_ids": list(view.token_ids),
            "text": view.text, "generating": view.generating, "pinned": view.pinned}


def fragment_of(body: SessionAppendRequest) -> str | list[int]:
    """The fragment an append carries: exactly one of text or token ids."""
    if (body.text is None) == (body.token_ids is None):
        raise InvalidRequestError("give exactly one of text or token_ids", param="text",
                                  code="invalid_request")
    return body.text if body.text is not None else list(body.token_ids or [])


@dataclass
class SegmentRun:
    """One generation segment under way. `events()` yields a chunk dict per output with text
    (`session.generation.chunk`) and, last, the whole segment (`session.generation`);
    `collect()` runs it to the end and returns the whole. An iteration that ends early (its
    client left) stops the segment: the session stays, paused."""

    state: ServerState
    session_id: str
    body: SessionGenerateRequest
    num_tokens_before: int
    tool_names: list[str] | None
    gathered: OutputAccumulator = field(default_factory=OutputAccumulator)

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        engine, sid = self.state.engine, self.session_id
        done = False
        try:
            async for out in engine.outputs(sid):
                if out.error is not None:
                    done = True
                    raise RequestFailedError(out.error, code="request_failed")
                done = out.segment_finished or out.finished
                self.gathered.add(out)
                yield out
        except LoomError:  # the session was closed (deleted, expired) meanwhile
            done = True
            raise
        finally:
            if not done:
                await asyncio.shield(self._stop(sid))

    async def _stop(self, session_id: str) -> None:
        """Stop the segment its reader left (the session stays, paused), if it is live."""
        engine = self.state.engine
        if await engine.holds(session_id):
            await engine.stop_generation(session_id)

    def whole(self) -> dict[str, Any]:
        """The segment so far as one object (text, tokens, finish reason, tool calls,
        logprobs, usage, the request tree)."""
        out = self.gathered.result()
        comp = out.outputs[0]
        reason, calls = comp.finish_reason, {}
        if self.tool_names is not None:  # the text parsed as a chat message's, beside it
            message = tool_calls.message(comp.text, self.tool_names)
            found = message.get("tool_calls", [])
            calls = {"content": message["content"], "tool_calls": found}
            reason = tool_calls.finish_reason(reason, len(found))
        body = self.body
        return {"id": self.session_id, "object": "session.generation",
                "text": comp.text, "token_ids": comp.token_ids,
                "finish_reason": reason, **calls,
                "logprobs": completion_logprobs(comp, self.state.decode_token,
                                                body.logprobs or 0)
                if body.logprobs is not None else None,
                "usage": {"prompt_tokens": self.num_tokens_before,
                          "completion_tokens": len(comp.token_ids)},
                "children": request_tree(out)}

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Chunks as the segment generates, then the whole segment."""
        async for out in self._outputs():
            comp = out.outputs[0]  # a delta: the engine held back what a stop may cut
            finished = comp.finish_reason is not None
            whole = self.whole() if finished else None
            if comp.text or finished:
                yield {"id": self.session_id, "object": "session.generation.chunk",
                       "text": comp.text, "token_ids": comp.token_ids,
                       "finish_reason": whole["finish_reason"] if whole else None}
            if whole is not None:  # the whole segment (with its tool calls) comes last
                yield whole

    async def collect(self) -> dict[str, Any]:
        """Run the segment to its end; the whole segment."""
        async for _ in self._outputs():
            pass
        return self.whole()


class SessionService:
    """The sessions of one server (see the module docstring)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def open(self, owner: str, body: SessionCreateRequest) -> dict[str, Any]:
        """Open a session over a prompt (or messages): its prompt is computed and it
        pauses. A `QuotaExceededError` past the key's quota of open sessions."""
        state = self.state
        state.check_model(body.model)
        prompt = state.prompt_or_messages(body.prompt, body.messages,
                                          body.add_generation_prompt, tools=body.tools)
        quota = state.config.max_sessions_per_key
        if len(self._owned_by(owner)) >= quota:
            # At the limit: first forget this key's sessions that ended without the server
            # hearing of it (a replica's session expired, or was lost with its replica).
            for sid in self._owned_by(owner):
                if sid not in state.opening_sessions and not await self._live(sid):
                    state.session_owners.pop(sid, None)
        # Count and reserve with no await in between: concurrent creations see each other.
        owned = self._owned_by(owner)
        if len(owned) >= quota:
            raise QuotaExceededError(
                f"this API key has {len(owned)} open sessions, the most allowed "
                f"(--max-sessions-per-key={state.config.max_sessions_per_key}); close one "
                "first", code="too_many_sessions")
        session_id = f"sess-{uuid.uuid4().hex}"
        state.own_session(session_id, owner)
        state.opening_sessions.add(session_id)
        try:
            await state.engine.add_request(session_id, prompt, None, session=True,
                                           pin=body.pin, ttl_s=body.ttl_s)
        except BaseException:
            state.disown_session(session_id)
            raise
        finally:
            state.opening_sessions.discard(session_id)
        view = await state.engine.get_session(session_id)
        return {"id": session_id, "object": "session", "num_tokens": len(view.token_ids)}

    def _owned_by(self, owner: str) -> list[str]:
        """The ids of the sessions `owner` opened (or is opening) that the server knows."""
        return [sid for sid, key in self.state.session_owners.items() if key == owner]

    async def _live(self, session_id: str) -> bool:
        """Whether an engine holds the session (a lost one is not live)."""
        try:
            return await self.state.engine.holds(session_id)
        except SessionLostError:
            return False

    async def check_owner(self, session_id: str, owner: str) -> None:
        """A 404 unless `owner` owns a live session by this id (restored from the KV store
        after a restart); another key's session looks like a missing one."""
        state = self.state
        if not await state.owns_live_session(session_id, owner):
            if not await state.engine.holds(session_id):
                state.session_owners.pop(session_id, None)
            raise UnknownRequestError(f"unknown session {session_id!r}", param="id",
                                      code="session_not_found")

    async def view(self, session_id: str, owner: str) -> dict[str, Any]:
        """The session's tokens, text and status."""
        await self.check_owner(session_id, owner)
        return session_view(await self.state.engine.get_session(session_id))

    async def segment(self, session_id: str, owner: str, body: SessionGenerateRequest,
                      fragment: str | list[int] | None = None,
                      heal: bool = False) -> SegmentRun:
        """Start one generation segment, after appending `fragment` if given (the check,
        the append and the start are one engine call)."""
        await self.check_owner(session_id, owner)
        if body.n != 1:
            raise InvalidRequestError("a session generates one sequence: n must be 1",
                                      param="n", code="invalid_request")
        state = self.state
        # The constraint is checked before anything is appended: a refused one changes
        # nothing.
        constraint, where = requested_constraint(body)
        tools = plan_tools(body, constrained=constraint is not None)
        checked = await constrain(state, body.sampling_params(None, body.logprobs),
                                  constraint, where, tools)

        # Deltas: the segment's output is exactly what it generated, whatever a caller
        # appends to the session meanwhile. Its max_tokens is resolved by the engine for the
        # session's length (refused naming it, before anything is appended).
        params = body.sampling_params(None, body.logprobs).with_updates(
            output_kind=RequestOutputKind.DELTA, structured_outputs=checked.structured_outputs)
        before = await state.engine.start_segment(session_id, params, fragment, heal,
                                                  state.budget(body.max_tokens))
        return SegmentRun(state, session_id, body, len(before.token_ids),
                          tools.names if tools.parses else None)

    async def append(self, session_id: str, owner: str,
                     body: SessionAppendRequest) -> dict[str, Any] | SegmentRun:
        """Append text or token ids; with sampling parameters given, start a segment right
        after them (a `SegmentRun`), else the appended count."""
        await self.check_owner(session_id, owner)
        fragment = fragment_of(body)
        if body.starts_generation:
            # The fragment is appended first, so the segment's text and token counts start
            # after it; the step that computes the fragment samples the first token. A
            # session that is generating is refused (InvalidSessionStateError) before the
            # fragment is appended.
            return await self.segment(session_id, owner, body, fragment, heal=body.heal)
        engine = self.state.engine
        appended = await engine.append(session_id, fragment, heal=body.heal)
        view = await engine.get_session(session_id)
        return {"id": session_id, "object": "session", "appended_tokens": appended,
                "num_tokens": len(view.token_ids)}

    async def resample(self, session_id: str, owner: str,
                       body: SessionResampleRequest) -> dict[str, Any]:
        """Draw `n` tokens from the stored logits; the session does not change."""
        await self.check_owner(session_id, owner)
        params = body.sampling_params(max_tokens=1)
        samples = await self.state.engine.resample(session_id, params.with_updates(n=1),
                                                   body.n)
        return {"id": session_id, "object": "session.samples", "samples": [
            {"token_id": s.token_id, "text": s.text, "logprob": s.logprob} for s in samples]}

    async def rewind(self, session_id: str, owner: str, num_tokens: int) -> dict[str, Any]:
        """Drop the session's last tokens; the session as it is then."""
        await self.check_owner(session_id, owner)
        await self.state.engine.rewind(session_id, num_tokens)
        return session_view(await self.state.engine.get_session(session_id))

    async def stop(self, session_id: str, owner: str) -> bool:
        """End the session's segment now (it stays, paused); False when none ran."""
        await self.check_owner(session_id, owner)
        return await self.state.engine.stop_generation(session_id)

    async def close(self, session_id: str, owner: str) -> dict[str, Any]:
        """Close the session and free its KV (its kept state too)."""
        await self.check_owner(session_id, owner)
        await self.state.engine.close(session_id)
        self.state.disown_session(session_id)
        return {"id": session_id, "object": "session", "deleted": True}
