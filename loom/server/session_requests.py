"""Request bodies of Loom's live sessions (`/v1/sessions` and its WebSocket messages)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, WithJsonSchema

from loom.server.message_fields import ChatMessage, Tool, ToolFields
from loom.server.request_base import LIMIT, TOKEN_IDS_SCHEMA, ModelName, RequestBody, TokenId
from loom.server.request_fields import ConstraintFields, SamplingFields


class SessionCreateRequest(RequestBody):
    """`POST /v1/sessions`: a live session over a prompt (or a conversation)."""

    model: ModelName | None = None
    prompt: Annotated[str | list[TokenId] | None, WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1}, TOKEN_IDS_SCHEMA, {"type": "null"}]})] = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None  # rendered into the prompt with the messages
    # End the messages' prompt with the template's start of an assistant turn, so that the
    # first segment is the assistant's answer (off: the prompt ends after the last message).
    add_generation_prompt: bool = False
    pin: bool = False
    ttl_s: float | None = Field(default=None, gt=0)


class SessionGenerateRequest(SamplingFields, ConstraintFields, ToolFields, RequestBody):
    """`POST /v1/sessions/{id}/generate`: one generation segment (n must be 1). `tools`
    here change nothing in the session's text: they name what `tool_choice` may force and
    what the segment's text is parsed for."""

    logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False


class SessionAppendRequest(SessionGenerateRequest):
    """`POST /v1/sessions/{id}/append`: a fragment; any sampling parameter given (or
    `stream`) starts a generation segment right after it."""

    text: Annotated[str, Field(min_length=1)] | None = None
    token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    heal: bool = False

    @property
    def starts_generation(self) -> bool:
        """True when the body asks for a segment after the fragment."""
        sampling = set(SessionGenerateRequest.model_fields)
        return bool(self.model_fields_set & sampling)


class SessionResampleRequest(SamplingFields, RequestBody):
    """`POST /v1/sessions/{id}/resample`: draw `n` tokens from the stored logits."""


class SessionRewindRequest(RequestBody):
    """`POST /v1/sessions/{id}/rewind`: drop the last tokens."""

    num_tokens: int = Field(ge=1, json_schema_extra={LIMIT: "context"})
