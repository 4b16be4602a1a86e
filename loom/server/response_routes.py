"""OpenAI's Responses API over HTTP: a thin adapter over `ResponseService` (which knows no
transport). `stream=true` sends the service's events as server-sent events (`event:` the
type, `data:` the event), else the final response is the body."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse

from loom.errors import LoomError
from loom.server.errors import APIError, as_api_error, error_body
from loom.server.http_requests import authenticated, unless_disconnected
from loom.server.protocol import ResponsesRequest
from loom.server.response_service import ResponseService
from loom.server.wire import json_text

router = APIRouter(prefix="/v1/responses")


def service(request: Request) -> ResponseService:
    """The server's response service."""
    return request.app.state.responses


def _sse(event: dict[str, Any]) -> str:
    """One event as SSE: `event:` its type, `data:` it as strict JSON (-inf as null)."""
    return f"event: {event['type']}\ndata: {json_text(event)}\n\n"


@router.post("")
async def create_response(body: ResponsesRequest, request: Request,
                          key: str = Depends(authenticated)) -> Any:
    """A response: one turn of a conversation, continuing `previous_response_id`'s."""
    turn = await service(request).start(body, key)
    if not body.stream:
        async def drain() -> dict[str, Any]:
            last: dict[str, Any] = {}
            async for event in turn.events():
                last = event
            return last["response"]

        return await unless_disconnected(request, drain())

    async def events() -> AsyncIterator[str]:
        try:
            async for event in turn.events():
                yield _sse(event)
        except (APIError, LoomError) as raised:  # after the headers: an error event ends it
            error = as_api_error(raised)
            body = error_body(error.status, error.message, error.param, error.code)["error"]
            # OpenAI's error event: code, message and param of the error; its `type` is the
            # event's ("error"), not the error object's category.
            yield _sse({**body, "type": "error", "sequence_number": -1})

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


@router.get("/{response_id}")
async def get_response(response_id: str, request: Request,
                       key: str = Depends(authenticated)) -> Any:
    """A stored response."""
    return service(request).get(response_id, key)


@router.delete("/{response_id}")
async def delete_response(response_id: str, request: Request,
                          key: str = Depends(authenticated)) -> Any:
    """Forget a stored response and free its session."""
    await service(request).delete(response_id, key)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request,
                           order: Literal["asc", "desc"] = "desc",
                           limit: int = Query(default=20, ge=1, le=100),
                           after: str | None = None,
                           key: str = Depends(authenticated)) -> Any:
    """The input items of a stored response, newest first unless `order=asc`."""
    return service(request).input_items(response_id, key, order, limit, after)
