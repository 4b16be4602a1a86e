"""Request bodies of OpenAI's completions and chat routes, and vLLM's tokenize routes."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, WithJsonSchema

from loom.server.message_fields import ChatMessage, Tool, ToolFields
from loom.server.request_base import (
    LIMIT,
    TOKEN_IDS_SCHEMA,
    MaxTokens,
    ModelName,
    RequestBody,
    TokenId,
)
from loom.server.request_fields import ConstraintFields, SamplingFields, StreamOptions

# A prompt: text, token ids, or a batch of either; the route refuses an empty one (naming
# `prompt`), which the schema says, not the union (whose errors would name every member).
Prompt = Annotated[
    Annotated[str, Field(min_length=1)] | list[TokenId] | list[str] | list[list[TokenId]],
    WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1}, TOKEN_IDS_SCHEMA,
        {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "items": TOKEN_IDS_SCHEMA}]}),
]


class CompletionRequest(SamplingFields, ConstraintFields, RequestBody):
    """`POST /v1/completions`. `max_tokens: 0` with `echo` scores the prompt alone (with
    `logprobs`: what evaluation harnesses send); `prompt_logprobs` is vLLM's extra."""

    model: ModelName
    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=0, json_schema_extra={LIMIT: "max_tokens"})] | None = None
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None

    def prompt_logprobs_wanted(self) -> int | None:
        """Top logprobs per prompt position the response needs (None: none): `echo` with
        `logprobs`, and/or `prompt_logprobs`."""
        wanted = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs)
                  if n is not None]
        return max(wanted) if wanted else None


class ChatCompletionRequest(SamplingFields, ConstraintFields, ToolFields, RequestBody):
    """`POST /v1/chat/completions` (`prompt_logprobs`: vLLM's extra)."""

    model: ModelName
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    add_generation_prompt: bool = True
    # vLLM's: extra variables for the chat template (e.g. {"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: how hard a reasoning model thinks; a harmony model's (gpt-oss) system message
    # says it (low, medium, high). Other models' templates do not read it.
    reasoning_effort: str | None = None


class TokenizeRequest(RequestBody):
    """`POST /tokenize`: text, or messages through the chat template."""

    model: ModelName | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(RequestBody):
    """`POST /detokenize`."""

    model: ModelName | None = None
    tokens: list[TokenId]
