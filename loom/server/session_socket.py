"""A live session over one WebSocket (`/v1/sessions/{id}/ws`), a thin adapter over
`SessionService` for realtime clients: append, generate (tokens streamed as they come),
resample, rewind, stop, inspect and close without a request per operation.

Authentication is the HTTP API's: `Authorization: Bearer <key>` (or `?api_key=` for clients
that cannot set headers). A wrong key or a session the key does not own closes the socket
before it is accepted (code 1008). Then every message is a JSON object with a `type` and an
optional `id` the answers echo (as `ref`):

    -> {"type": "append", "text": "...", "max_tokens": 16, ...}    (SessionAppendRequest)
    -> {"type": "generate", "max_tokens": 16, ...}                  (SessionGenerateRequest)
    -> {"type": "resample", "n": 2, ...}  {"type": "rewind", "num_tokens": 3}
    -> {"type": "get"}  {"type": "stop"}  {"type": "close"}
    <- {"type": "appended" | "session" | "samples" | "stopped" | "closed", "ref": ..., ...}
    <- {"type": "generation.chunk", ...} per chunk, then {"type": "generation", ...} whole
    <- {"type": "error", "ref": ..., "status": 400, "error": {...OpenAI's error object}}

A segment streams while the socket keeps reading, so `stop` (or an append, which the
segment continues after) acts mid-generation. A refused message changes nothing and the
socket stays open; a client that disconnects stops its running segment (the session stays).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from loom.errors import LoomError
from loom.server.errors import APIError, as_api_error, error_body, from_loom_error, invalid_body
from loom.server.limits import check_api_key
from loom.server.protocol import (
    SessionAppendRequest,
    SessionGenerateRequest,
    SessionResampleRequest,
    SessionRewindRequest,
)
from loom.server.session_service import SegmentRun, SessionService

router = APIRouter()

# Close code for a refused connection (RFC 6455: a policy violation).
POLICY_VIOLATION = 1008


class _Socket:
    """One connection: its session, its owner, the segment it streams."""

    def __init__(self, websocket: WebSocket, sessions: SessionService, session_id: str,
                 owner: str) -> None:
        self.ws = websocket
        self.sessions = sessions
        self.session_id = session_id
        self.owner = owner
        self._send_lock = asyncio.Lock()
        self.segment: asyncio.Task[None] | None = None

    async def send(self, message: dict[str, Any]) -> None:
        async with self._send_lock:
            await self.ws.send_text(json.dumps(message, ensure_ascii=False))

    async def send_error(self, ref: Any, error: APIError) -> None:
        await self.send({"type": "error", "ref": ref, "status": error.status,
                         **error_body(error.status, error.message, error.param, error.code)})

    async def _report(self, ref: Any, error: APIError) -> None:
        """An error event, unless the client has gone."""
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            await self.send_error(ref, error)

    def _stream(self, run: SegmentRun, ref: Any) -> None:
        async def stream() -> None:
            try:
                async for event in run.events():
                    kind = event["object"].removeprefix("session.")
                    await self.send({"type": kind, "ref": ref, **event})
            except WebSocketDisconnect:
                pass  # the client left mid-segment: leaving the iteration stopped it
            except Exception as error:  # the segment failed: the client hears of it
                await self._report(ref, as_api_error(error))

        self.segment = asyncio.ensure_future(stream())

    async def handle(self, message: dict[str, Any]) -> bool:
        """Act on one message; False once the session is closed."""
        ref = message.pop("id", None)
        kind = message.pop("type", None)
        sessions, sid, owner = self.sessions, self.session_id, self.owner
        if kind == "append":
            result = await sessions.append(sid, owner, SessionAppendRequest.model_validate(
                message))
            if isinstance(result, SegmentRun):
                self._stream(result, ref)
            else:
                await self.send({"type": "appended", "ref": ref, **result})
        elif kind == "generate":
            run = await sessions.segment(sid, owner,
                                         SessionGenerateRequest.model_validate(message))
            self._stream(run, ref)
        elif kind == "resample":
            result = await sessions.resample(sid, owner,
                                             SessionResampleRequest.model_validate(message))
            await self.send({"type": "samples", "ref": ref, **result})
        elif kind == "rewind":
            body = SessionRewindRequest.model_validate(message)
            await self.send({"type": "session", "ref": ref,
                             **await sessions.rewind(sid, owner, body.num_tokens)})
        elif kind == "get":
            await self.send({"type": "session", "ref": ref, **await sessions.view(sid, owner)})
        elif kind == "stop":
            stopped = await sessions.stop(sid, owner)
            await self.send({"type": "stopped", "ref": ref, "stopped": stopped})
        elif kind == "close":
            await self.send({"type": "closed", "ref": ref,
                             **await sessions.close(sid, owner)})
            return False
        else:
            raise APIError(400, f"unknown message type {kind!r} (append, generate, resample, "
                                "rewind, get, stop, close)", param="type")
        return True

    async def run(self) -> None:
        """Read and act on messages until the client leaves or closes the session."""
        try:
            while True:
                text = await self.ws.receive_text()
                ref = None
                try:
                    message = json.loads(text)
                    if not isinstance(message, dict):
                        raise APIError(400, "a message must be a JSON object")
                    ref = message.get("id")
                    if not await self.handle(message):
                        break
                except ValueError as error:  # json.JSONDecodeError
                    if isinstance(error, ValidationError):
                        await self.send_error(ref, invalid_body(error))
                    else:
                        await self.send_error(ref, APIError(400, f"malformed JSON: {error}"))
                except APIError as error:
                    await self.send_error(ref, error)
                except LoomError as error:
                    await self.send_error(ref, from_loom_error(error))
            if self.segment is not None:
                await self.segment
            await self.ws.close()
        except WebSocketDisconnect:
            pass
        finally:
            if self.segment is not None and not self.segment.done():
                self.segment.cancel()  # its iteration's end stops the segment
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self.segment


@router.websocket("/v1/sessions/{session_id}/ws")
async def session_socket(websocket: WebSocket, session_id: str) -> None:
    """A live session over one socket (see the module docstring)."""
    state = websocket.app.state.loom
    sessions: SessionService = websocket.app.state.sessions
    authorization = websocket.headers.get("authorization")
    if authorization is None and "api_key" in websocket.query_params:
        authorization = f"Bearer {websocket.query_params['api_key']}"
    owner = check_api_key(authorization, state.config.api_keys)
    if owner is None:
        await websocket.close(code=POLICY_VIOLATION, reason="missing or invalid API key")
        return
    try:
        await sessions.check_owner(session_id, owner)
    except APIError as error:
        await websocket.close(code=POLICY_VIOLATION, reason=error.message)
        return
    await websocket.accept()
    await _Socket(websocket, sessions, session_id, owner).run()
