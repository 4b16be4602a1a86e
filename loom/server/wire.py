"""JSON text as the server sends it in SSE events and WebSocket frames: strictly valid JSON
(a non-finite float, such as the logprob -inf of a token a constraint forbids, is `null`,
never `-Infinity`), non-ASCII characters unescaped, dict order kept."""

from __future__ import annotations

from typing import Any

from pydantic_core import to_json


def json_text(data: Any) -> str:
    """`data` as one line of strict JSON (non-finite floats as null)."""
    return to_json(data, inf_nan_mode="null").decode()
