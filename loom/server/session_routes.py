"""Live sessions over HTTP (Loom's extension), a thin adapter over `SessionService`: open,
append, generate, resample, rewind, inspect, close. A session belongs to the API key that
opened it; other keys get 404. Segments answer JSON, or SSE with `stream: true`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request

from loom.server.http_requests import authenticated, unless_disconnected
from loom.server.openai_routes import _sse_response
from loom.server.protocol import (
    SessionAppendRequest,
    SessionCreateRequest,
    SessionGenerateRequest,
    SessionResampleRequest,
    SessionRewindRequest,
)
from loom.server.responses import sse
from loom.server.session_service import SegmentRun, SessionService

router = APIRouter(prefix="/v1/sessions")


def get_sessions(request: Request) -> SessionService:
    """The server's session service."""
    return request.app.state.sessions


async def _answer(request: Request, run: SegmentRun, stream: bool) -> Any:
    """A segment as one JSON object (its client leaving stops it) or as SSE events."""
    if not stream:
        return await unless_disconnected(request, run.collect())

    async def events() -> AsyncIterator[str]:
        async for event in run.events():
            yield sse(event)

    return _sse_response(events())


@router.post("")
async def create_session(body: SessionCreateRequest, request: Request,
                         key: str = Depends(authenticated)) -> Any:
    """Open a session over a prompt (or messages): its prompt is computed and it pauses."""
    return await get_sessions(request).open(key, body)


@router.post("/{session_id}/generate")
async def generate(session_id: str, body: SessionGenerateRequest, request: Request,
                   key: str = Depends(authenticated)) -> Any:
    """Generate one segment from the session's stored logits, then pause again."""
    run = await get_sessions(request).segment(session_id, key, body)
    return await _answer(request, run, body.stream)


@router.post("/{session_id}/append")
async def append(session_id: str, body: SessionAppendRequest, request: Request,
                 key: str = Depends(authenticated)) -> Any:
    """Append text or token ids; with sampling parameters, generate a segment after them."""
    result = await get_sessions(request).append(session_id, key, body)
    if isinstance(result, SegmentRun):
        return await _answer(request, result, body.stream)
    return result


@router.post("/{session_id}/resample")
async def resample(session_id: str, body: SessionResampleRequest, request: Request,
                   key: str = Depends(authenticated)) -> Any:
    """Draw `n` tokens from the stored logits; the session does not change."""
    return await unless_disconnected(
        request, get_sessions(request).resample(session_id, key, body))


@router.post("/{session_id}/rewind")
async def rewind(session_id: str, body: SessionRewindRequest, request: Request,
                 key: str = Depends(authenticated)) -> Any:
    """Drop the session's last tokens."""
    return await get_sessions(request).rewind(session_id, key, body.num_tokens)


@router.get("/{session_id}")
async def get_session(session_id: str, request: Request,
                      key: str = Depends(authenticated)) -> Any:
    """The session's tokens, text and status."""
    return await get_sessions(request).view(session_id, key)


@router.delete("/{session_id}")
async def close_session(session_id: str, request: Request,
                        key: str = Depends(authenticated)) -> Any:
    """Close the session and free its KV."""
    return await get_sessions(request).close(session_id, key)
