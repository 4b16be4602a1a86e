"""Live sessions over HTTP (Loom's extension): open, append, generate, resample, rewind,
inspect, close. A session belongs to the API key that opened it; other keys get 404."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request

from loom.engine.outputs import OutputAccumulator, RequestOutput
from loom.engine.sessions import SessionView
from loom.errors import LoomError
from loom.sampling_params import RequestOutputKind
from loom.server import tool_calls
from loom.server.constraints import constrain, requested_constraint
from loom.server.errors import APIError, from_loom_error
from loom.server.openai_routes import _sse_response, authenticated, get_state
from loom.server.protocol import (
    SessionAppendRequest,
    SessionCreateRequest,
    SessionGenerateRequest,
    SessionResampleRequest,
    SessionRewindRequest,
)
from loom.server.responses import completion_logprobs, request_tree, sse
from loom.server.state import ServerState
from loom.server.tools import plan_tools

router = APIRouter(prefix="/v1/sessions")


async def _owned(state: ServerState, session_id: str, key: str) -> str:
    """The session id when `key` owns a live session by that id (restored from the KV store
    after a restart); else 404 (never telling another key's session from a missing one)."""
    if not await state.owns_live_session(session_id, key):
        if not state.engine.is_live(session_id):
            state.session_owners.pop(session_id, None)
        raise APIError(404, f"unknown session {session_id!r}", param="id",
                       code="session_not_found")
    return session_id


def _view(view: SessionView) -> dict[str, Any]:
    return {"id": view.request_id, "object": "session", "status": view.status,
            "num_tokens": len(view.token_ids), "num_prompt_tokens": view.num_prompt_tokens,
            "num_computed_tokens": view.num_computed_tokens, "token_ids": list(view.token_ids),
            "text": view.text, "generating": view.generating, "pinned": view.pinned}


@router.post("")
async def create_session(body: SessionCreateRequest, request: Request,
                         key: str = Depends(authenticated)) -> Any:
    """Open a session over a prompt (or messages): its prompt is computed and it pauses."""
    state = get_state(request)
    state.check_model(body.model)
    prompt = state.prompt_or_messages(body.prompt, body.messages, body.add_generation_prompt,
                                      tools=body.tools)
    # Count and reserve with no await in between: concurrent creations see each other.
    owned = [sid for sid, owner in state.session_owners.items() if owner == key
             and (sid in state.opening_sessions or state.engine.is_live(sid))]
    if len(owned) >= state.config.max_sessions_per_key:
        raise APIError(429, f"this API key has {len(owned)} open sessions, the most allowed "
                            f"(--max-sessions-per-key={state.config.max_sessions_per_key}); "
                            "close one first", code="too_many_sessions")
    session_id = f"sess-{uuid.uuid4().hex}"
    state.own_session(session_id, key)
    state.opening_sessions.add(session_id)
    try:
        await state.engine.add_request(session_id, prompt, None, session=True, pin=body.pin,
                                       ttl_s=body.ttl_s)
    except BaseException:
        state.disown_session(session_id)
        raise
    finally:
        state.opening_sessions.discard(session_id)
    view = await state.engine.get_session(session_id)
    return {"id": session_id, "object": "session", "num_tokens": len(view.token_ids)}


async def _segment(state: ServerState, session_id: str, body: SessionGenerateRequest,
                   request: Request, fragment: str | list[int] | None = None,
                   heal: bool = False) -> Any:
    """Run one generation segment, after appending `fragment` if given (the check, the append
    and the start are one engine call): its text, tokens and finish reason (or a stream of
    them). A client that leaves stops the segment; the session stays."""
    if body.n != 1:
        raise APIError(400, "a session generates one sequence: n must be 1", param="n")
    engine = state.engine
    # The constraint is checked before anything is appended: a refused one changes nothing.
    constraint, field = requested_constraint(body)
    tools = plan_tools(body, constrained=constraint is not None)
    checked = await constrain(state, body.sampling_params(None, body.logprobs), constraint,
                              field, tools)
    names = tools.names if tools.parses else None  # None: no tool calls parsed

    def params_for(num_tokens: int) -> Any:
        params = body.sampling_params(state.max_tokens(body.max_tokens, num_tokens + 1),
                                      body.logprobs)
        # Deltas: the segment's output is exactly what it generated, whatever a caller
        # appends to the session meanwhile.
        return params.with_updates(output_kind=RequestOutputKind.DELTA,
                                   structured_outputs=checked.structured_outputs)

    before, _ = await engine.start_segment(session_id, params_for, fragment, heal)
    decode = state.decode_token
    top_n = body.logprobs or 0
    gathered = OutputAccumulator()

    async def outputs() -> AsyncIterator[RequestOutput]:
        done = False
        try:
            async for out in engine.outputs(session_id):
                if out.error is not None:
                    done = True
                    raise APIError(503, out.error, code="request_failed")
                done = out.segment_finished or out.finished
                gathered.add(out)
                yield out
        except LoomError as error:  # the session was closed (deleted, expired) meanwhile
            done = True
            raise from_loom_error(error) from None
        finally:
            if not done and engine.is_live(session_id):
                await asyncio.shield(engine.stop_generation(session_id))

    def result() -> dict[str, Any]:
        out = gathered.result()
        comp = out.outputs[0]
        reason, calls = comp.finish_reason, {}
        if names is not None:  # the text parsed as a chat message's, beside it
            message = tool_calls.message(comp.text, names)
            found = message.get("tool_calls", [])
            calls = {"content": message["content"], "tool_calls": found}
            reason = tool_calls.finish_reason(reason, len(found))
        return {"id": session_id, "object": "session.generation",
                "text": comp.text, "token_ids": comp.token_ids,
                "finish_reason": reason, **calls,
                "logprobs": completion_logprobs(comp, decode, top_n)
                if body.logprobs is not None else None,
                "usage": {"prompt_tokens": len(before.token_ids),
                          "completion_tokens": len(comp.token_ids)},
                "children": request_tree(out)}

    if not body.stream:
        async def collect() -> dict[str, Any]:
            async for _ in outputs():
                pass
            return result()

        return await state.unless_disconnected(request, collect())

    async def events() -> AsyncIterator[str]:
        async for out in outputs():
            comp = out.outputs[0]  # a delta: the engine held back what a stop may cut
            finished = comp.finish_reason is not None
            whole = result() if finished else None
            if comp.text or finished:
                yield sse({"id": session_id, "object": "session.generation.chunk",
                           "text": comp.text, "token_ids": comp.token_ids,
                           "finish_reason": whole["finish_reason"] if whole else None})
            if whole is not None:  # the whole segment (with its tool calls) comes last
                yield sse(whole)

    return _sse_response(events())


@router.post("/{session_id}/generate")
async def generate(session_id: str, body: SessionGenerateRequest, request: Request,
                   key: str = Depends(authenticated)) -> Any:
    """Generate one segment from the session's stored logits, then pause again."""
    state = get_state(request)
    await _owned(state, session_id, key)
    return await _segment(state, session_id, body, request)


@router.post("/{session_id}/append")
async def append(session_id: str, body: SessionAppendRequest, request: Request,
                 key: str = Depends(authenticated)) -> Any:
    """Append text or token ids; with sampling parameters, generate a segment after them."""
    state = get_state(request)
    await _owned(state, session_id, key)
    if (body.text is None) == (body.token_ids is None):
        raise APIError(400, "give exactly one of text or token_ids", param="text")
    fragment: str | list[int] = body.text if body.text is not None else list(body.token_ids or [])
    if body.starts_generation:
        if body.n != 1:
            raise APIError(400, "a session generates one sequence: n must be 1", param="n")
        # The fragment is appended first, so the segment's text and token counts start after
        # it; the step that computes the fragment samples the first token. A session that is
        # generating is refused (409) before the fragment is appended.
        return await _segment(state, session_id, body, request, fragment, heal=body.heal)
    appended = await state.engine.append(session_id, fragment, heal=body.heal)
    view = await state.engine.get_session(session_id)
    return {"id": session_id, "object": "session", "appended_tokens": appended,
            "num_tokens": len(view.token_ids)}


@router.post("/{session_id}/resample")
async def resample(session_id: str, body: SessionResampleRequest, request: Request,
                   key: str = Depends(authenticated)) -> Any:
    """Draw `n` tokens from the stored logits; the session does not change."""
    state = get_state(request)
    await _owned(state, session_id, key)
    params = body.sampling_params(max_tokens=1)
    samples = await state.unless_disconnected(
        request, state.engine.resample(session_id, params.with_updates(n=1), body.n))
    return {"id": session_id, "object": "session.samples", "samples": [
        {"token_id": s.token_id, "text": s.text, "logprob": s.logprob} for s in samples]}


@router.post("/{session_id}/rewind")
async def rewind(session_id: str, body: SessionRewindRequest, request: Request,
                 key: str = Depends(authenticated)) -> Any:
    """Drop the session's last tokens."""
    state = get_state(request)
    await _owned(state, session_id, key)
    await state.engine.rewind(session_id, body.num_tokens)
    return _view(await state.engine.get_session(session_id))


@router.get("/{session_id}")
async def get_session(session_id: str, request: Request,
                      key: str = Depends(authenticated)) -> Any:
    """The session's tokens, text and status."""
    state = get_state(request)
    await _owned(state, session_id, key)
    return _view(await state.engine.get_session(session_id))


@router.delete("/{session_id}")
async def close_session(session_id: str, request: Request,
                        key: str = Depends(authenticated)) -> Any:
    """Close the session and free its KV."""
    state = get_state(request)
    await _owned(state, session_id, key)
    await state.engine.close(session_id)
    state.disown_session(session_id)
    return {"id": session_id, "object": "session", "deleted": True}
