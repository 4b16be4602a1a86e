"""A live session over one WebSocket (`/v1/sessions/{id}/ws`), a thin adapter over
`SessionService` for realtime clients: append, generate (tokens streamed as they come),
resample, rewind, stop, inspect and close without a request per operation.

Authentication is the HTTP API's: `Authorization: Bearer <key>` (or `?api_key=` for clients
that cannot set headers); a missing or wrong key closes the socket before it is accepted
(code 1008, a refused handshake). A session that is unknown, closed or another key's is the
HTTP API's 404: the socket is accepted, sends one error event (`status` 404, `code`
"session_not_found") and closes with code 4404; so does an open socket whose session ended
meanwhile (closed over HTTP, expired), at its next message. Every message is a JSON object
in a text frame, with a `type` and an optional `id` the answers echo (as `ref`):

    -> {"type": "append", "text": "...", "max_tokens": 16, ...}    (SessionAppendRequest)
    -> {"type": "generate", "max_tokens": 16, ...}                  (SessionGenerateRequest)
    -> {"type": "resample", "n": 2, ...}  {"type": "rewind", "num_tokens": 3}
    -> {"type": "get"}  {"type": "stop"}  {"type": "close"}
    <- {"type": "appended" | "session" | "samples" | "stopped" | "closed", "ref": ..., ...}
    <- {"type": "generation.chunk", ...} per chunk, then {"type": "generation", ...} whole
    <- {"type": "error", "ref": ..., "status": 400, "error": {...OpenAI's error object}}

An error event's `status` is the HTTP API's status for the same failure and `error.code` a
string: "binary_frame" (a binary frame), "invalid_json" (a text frame that is not JSON),
"invalid_value" (a message that is not an object or a field the HTTP body would refuse, the
field in `error.param`), "session_not_found", "conflict" (generating), ...

A segment streams while the socket keeps reading, so `stop` (or an append, which the
segment continues after) acts mid-generation. A refused message changes nothing and the
socket stays open; a client that disconnects stops its running segment (the session stays).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from loom.errors import AuthenticationError, LoomError
from loom.server.errors import (
    APIError,
    as_api_error,
    error_body,
    internal_error,
    invalid_body,
    unpaired_surrogate,
)
from loom.server.protocol import (
    SessionAppendRequest,
    SessionGenerateRequest,
    SessionResampleRequest,
    SessionRewindRequest,
)
from loom.server.protocol import unpaired_surrogate as surrogate_field
from loom.server.session_service import SegmentRun, SessionService
from loom.server.wire import json_text

router = APIRouter()
logger = logging.getLogger("loom.server")

# Close codes (RFC 6455): a refused key, before the socket is accepted (a policy violation);
# the socket's session does not exist (the private range 4000-4999: 4000 + HTTP's 404).
POLICY_VIOLATION = 1008
SESSION_NOT_FOUND = 4404
_NOT_FOUND = "session_not_found"  # the error code that ends a socket (SESSION_NOT_FOUND)


def _message(text: str | None) -> dict[str, Any]:
    """A frame's message: a JSON object in a text frame (`text` None: a binary frame), with
    no unpaired surrogate in any string; an APIError saying what is wrong otherwise."""
    if text is None:
        raise APIError(400, "binary frames are not supported: send each message as JSON "
                            "in a text frame", code="binary_frame")
    try:
        message = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        raise APIError(400, f"malformed JSON: {error}", code="invalid_json") from None
    if not isinstance(message, dict):
        raise APIError(400, f"a message must be a JSON object, not {type(message).__name__}",
                       code="invalid_value")
    field = surrogate_field(message)
    if field is not None:
        raise unpaired_surrogate(field)
    return message


def _refusal(error: Exception) -> APIError:
    """What a message that failed is answered with: the HTTP API's error for the same
    failure; an unexpected exception is a 500 (logged), and the socket goes on."""
    if isinstance(error, ValidationError):
        return invalid_body(error)
    if isinstance(error, APIError | LoomError):
        return as_api_error(error)
    logger.error("unexpected error on a session socket", exc_info=error)
    return internal_error(error)


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
        self.close_code = 1000  # SESSION_NOT_FOUND once the session is gone

    async def send(self, message: dict[str, Any]) -> None:
        """One event as JSON text, as the HTTP API writes it (a logprob of -inf as null)."""
        async with self._send_lock:
            await self.ws.send_text(json_text(message))

    async def receive(self) -> str | None:
        """The next frame's text (None: a binary frame); WebSocketDisconnect once the client
        has gone."""
        frame = await self.ws.receive()
        if frame["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(frame.get("code", 1000), frame.get("reason"))
        return frame.get("text")

    async def send_error(self, ref: Any, error: APIError) -> None:
        """An error event: the HTTP status and OpenAI's error body."""
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
                                "rewind, get, stop, close)", param="type", code="invalid_value")
        return True

    async def serve(self, text: str | None) -> bool:
        """Act on one frame, answering a failure with an error event; False once the socket
        is done (the session closed by a message, or gone)."""
        ref = None
        try:
            message = _message(text)
            ref = message.get("id")
            return await self.handle(message)
        except WebSocketDisconnect:
            raise
        except Exception as error:
            refusal = _refusal(error)
            await self.send_error(ref, refusal)
            if refusal.code == _NOT_FOUND:
                self.close_code = SESSION_NOT_FOUND
                return False
            return True

    async def run(self) -> None:
        """Read and act on messages until the client leaves or the session is closed or
        gone (then close code 4404)."""
        try:
            while await self.serve(await self.receive()):
                pass
            if self.segment is not None:
                await self.segment
            await self.ws.close(code=self.close_code)
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
    try:
        owner = state.authenticate(authorization)
    except AuthenticationError:
        await websocket.close(code=POLICY_VIOLATION, reason="missing or invalid API key")
        return
    socket = _Socket(websocket, sessions, session_id, owner)
    await websocket.accept()
    try:
        await sessions.check_owner(session_id, owner)
    except LoomError as error:  # a 404, as over HTTP: said in an event, then closed
        await socket.send_error(None, _refusal(error))
        await websocket.close(code=SESSION_NOT_FOUND, reason="session not found")
        return
    await socket.run()
