"""The request body of OpenAI's Responses API (`POST /v1/responses`) and its parts."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from loom.sampling_params import SamplingParams
from loom.server.message_fields import (
    FUNCTION_NAME_PATTERN,
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
    Tool,
    ToolFields,
)
from loom.server.request_base import (
    MaxTokens,
    ModelName,
    RequestBody,
    StrictModel,
    without_ignored_fields,
)

# Responses fields clients send that change nothing here: dropped with one logged warning.
# (`include` asks for extra output fields Loom does not produce; `truncation` "disabled" is
# Loom's behaviour, a prompt past the context is a 400.)
IGNORED_RESPONSE_FIELDS = frozenset({
    "service_tier", "safety_identifier", "prompt_cache_key", "include", "truncation",
    "user", "stream_options", "top_logprobs", "prompt_cache_retention",
})


class ResponseTextFormat(StrictModel):
    """`text.format`: free text, any JSON object, or JSON following `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseText(StrictModel):
    """`text`: the output's format (`verbosity` changes nothing here)."""

    format: ResponseTextFormat | None = None
    verbosity: str | None = None


class ResponseFunctionTool(StrictModel):
    """A function tool as the Responses API declares it (flat: no `function` object)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> Tool:
        """The same function as chat completions' `tools` entry."""
        return Tool(type="function", function=FunctionDefinition(
            name=self.name, description=self.description, parameters=self.parameters,
            strict=self.strict))


class ResponseReasoning(StrictModel):
    """`reasoning`: how hard a reasoning model thinks (`effort`: a harmony model's system
    message says it; other models' templates do not read it). Summaries of reasoning are not
    produced (`summary` changes nothing)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponseNamedToolChoice(StrictModel):
    """`tool_choice: {"type": "function", "name": ...}`."""

    type: Literal["function"]
    name: str = Field(json_schema_extra={"pattern": FUNCTION_NAME_PATTERN})


class ResponsesRequest(RequestBody):
    """`POST /v1/responses`. `input` items are checked by the response service (an error
    names the item's field, `input[2].call_id`)."""

    model: ModelName | None = None
    input: Annotated[str, Field(min_length=1)] | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedToolChoice | None = None
    parallel_tool_calls: bool = True
    text: ResponseText | None = None
    reasoning: ResponseReasoning | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63 - 1024)
    store: bool = True
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    stream: bool = False
    background: Literal[False] = False  # background responses are not supported

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored_fields(cls, data: Any) -> Any:
        """Remove IGNORED_RESPONSE_FIELDS, with one warning naming them."""
        return without_ignored_fields(data, IGNORED_RESPONSE_FIELDS, cls.model_fields)

    def chat_tools(self) -> ToolFields:
        """`tools`, `tool_choice`, `parallel_tool_calls` as chat completions' fields."""
        choice: Any = self.tool_choice
        if isinstance(choice, ResponseNamedToolChoice):
            choice = NamedToolChoice(type="function", function=FunctionName(name=choice.name))
        return ToolFields(tools=[t.as_chat_tool() for t in self.tools or ()] or None,
                          tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters (OpenAI's defaults: temperature 1, top_p 1)."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed,
            max_tokens=max_tokens)
