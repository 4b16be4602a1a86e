"""Request bodies of the HTTP API (pydantic): OpenAI's shapes, vLLM's extras, Loom's sessions.

Unknown fields are rejected (`extra="forbid"`) so a misspelt parameter is an error naming it,
not a silently ignored value. Responses are plain dicts built in `responses.py`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic_core import PydanticCustomError

from loom.errors import InvalidSamplingParamsError
from loom.sampling_params import SamplingParams

NonNegInt = Annotated[int, Field(ge=0)]

# Limits that depend on the served model or the server's flags: the published schema
# (api_docs.py) fills them in where a field's schema carries this key, with its kind
# ("token_id", "token_id_key", "max_tokens", "context": tokens of a session, "model").
LIMIT = "x-loom-limit"
# A token id: below the vocabulary size (the engine's input processor checks it).
TokenId = Annotated[int, Field(ge=0, json_schema_extra={LIMIT: "token_id"})]
# A number of tokens to generate: at most --max-tokens-cap and the context less a token.
MaxTokens = Annotated[int, Field(ge=1, json_schema_extra={LIMIT: "max_tokens"})]
# A model name: the one this server serves (another is a 404).
ModelName = Annotated[str, Field(json_schema_extra={LIMIT: "model"})]
# A token id as a JSON object's key (logit_bias): digits naming an id below the vocabulary.
_TOKEN_ID_KEY = {"type": "string", "pattern": r"^\s*[0-9]+\s*$", LIMIT: "token_id_key"}

logger = logging.getLogger("loom.server")

# Fields OpenAI and vLLM clients send that change nothing a generation returns here: they
# are accepted, named in a logged warning and dropped (as vLLM does with fields it ignores),
# unless the request's model declares the field (chat takes `chat_template_kwargs`; a
# completion has no template). Any other unknown field stays a 400 naming it: a field that
# would change the result (beam search, prompt truncation, ...) must not be silently
# ignored, and a misspelt one should be found.
IGNORED_FIELDS = frozenset({
    "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key",
    "request_id", "cache_salt", "chat_template_kwargs",
})


def without_ignored_fields(data: Any, ignorable: frozenset[str],
                           declared: Iterable[str]) -> Any:
    """A request body without the `ignorable` fields it carries (those the model does not
    declare), named in one logged warning."""
    if not isinstance(data, dict):
        return data
    ignored = sorted((ignorable & data.keys()) - set(declared))
    if not ignored:
        return data
    logger.warning("ignoring request fields that change nothing here: %s", ", ".join(ignored))
    return {k: v for k, v in data.items() if k not in ignored}


class StrictModel(BaseModel):
    """A request body or a part of one: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid")


# A UTF-16 surrogate code point: JSON's `\ud800` escapes parse to one when unpaired (a pair
# parses to the character it encodes), and no UTF-8 text, tokenizer or answer can carry it.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _shown(key: Any) -> str:
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")


def unpaired_surrogate(value: Any) -> str | None:
    """The path (`messages.0.content`) of the first string in parsed JSON, an object's key
    or a value, that holds an unpaired surrogate; None when there is none."""
    stack: list[tuple[Any, str]] = [(value, "")]  # iterative: any depth of nesting
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                where = f"{path}.{_shown(key)}" if path else _shown(key)
                if isinstance(key, str) and _SURROGATE.search(key):
                    return where
                children.append((child, where))
            stack.extend(reversed(children))  # popped in document order
        elif isinstance(item, list | tuple):
            stack.extend(reversed([(child, f"{path}.{i}" if path else str(i))
                                   for i, child in enumerate(item)]))
    return None


class RequestBody(StrictModel):
    """A whole request body (a route's, a WebSocket message's): every string in it, at any
    depth, is checked once here for text no UTF-8 can carry, a 400 naming the field."""

    @model_validator(mode="before")
    @classmethod
    def _reject_unpaired_surrogates(cls, data: Any) -> Any:
        """Refuse a body with an unpaired surrogate anywhere (errors.py names the field)."""
        field = unpaired_surrogate(data)
        if field is not None:
            raise PydanticCustomError("unpaired_surrogate",
                                      "{field} holds an unpaired UTF-16 surrogate",
                                      {"field": field})
        return data


class StreamOptions(StrictModel):
    """OpenAI's `stream_options`."""

    include_usage: bool = False


class SamplingFields(StrictModel):
    """Sampling parameters shared by every generating endpoint (OpenAI names, vLLM extras)."""

    max_tokens: MaxTokens | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63 - 1024)
    n: int = Field(default=1, ge=1, le=16)
    # Stop strings must not be empty (SamplingParams says so, naming stop).
    stop: Annotated[str | list[str] | None, WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}}, {"type": "null"}]})
    ] = None
    stop_token_ids: list[NonNegInt] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=100.0)
    min_tokens: int = Field(default=0, ge=0, json_schema_extra={LIMIT: "max_tokens"})
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI's map of token id (a JSON object's string key) to a bias in [-100, 100].
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, json_schema_extra={"propertyNames": _TOKEN_ID_KEY})
    user: str | None = None
    # vLLM's scheduling priority (lower first among waiting work).
    priority: int = 0

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored_fields(cls, data: Any) -> Any:
        """Remove IGNORED_FIELDS from a request body, with one warning naming them."""
        return without_ignored_fields(data, IGNORED_FIELDS, cls.model_fields)

    def sampling_params(self, max_tokens: int | None,
                        logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters (OpenAI's defaults: temperature 1, top_p 1)."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            max_tokens=max_tokens,
            logprobs=logprobs,
            logit_bias=self._logit_bias(),
            priority=self.priority,
        )

    def _logit_bias(self) -> dict[int, float] | None:
        """`logit_bias` with integer token ids (a key that is not one is named)."""
        if not self.logit_bias:
            return None
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            if not (key.strip().isascii() and key.strip().isdigit()):
                raise InvalidSamplingParamsError(
                    f"invalid sampling parameter logit_bias={self.logit_bias!r}: key {key!r} "
                    "is not a token id")
            bias[int(key)] = value
        return bias


class JSONSchemaFormat(StrictModel):
    """`response_format.json_schema`: the schema the output must follow (always enforced:
    `strict` is accepted and changes nothing)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsField(StrictModel):
    """vLLM's `structured_outputs` extra: exactly one constraint (see
    `loom.sampling_params.StructuredOutputsParams`)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None


class ConstraintFields(StrictModel):
    """Constraints on a generation's language (`loom/server/constraints.py` reads them)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None


class FunctionDefinition(StrictModel):
    """A function the model may call: its name, what it does, its arguments' JSON schema."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    """One entry of `tools` (only functions exist)."""

    type: Literal["function"]
    function: FunctionDefinition


# A function's name (a named tool_choice that matches none is refused as naming no tool).
_FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class FunctionName(StrictModel):
    """The function a named `tool_choice` forces."""

    name: str = Field(json_schema_extra={"pattern": _FUNCTION_NAME})


class NamedToolChoice(StrictModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(StrictModel):
    """OpenAI's tool calling (`loom/server/tools.py` reads them)."""

    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True


_TOKEN_IDS = {"type": "array", "minItems": 1,
               "items": {"type": "integer", "minimum": 0, LIMIT: "token_id"}}
# A prompt: text, token ids, or a batch of either; the route refuses an empty one (naming
# `prompt`), which the schema says, not the union (whose errors would name every member).
Prompt = Annotated[
    Annotated[str, Field(min_length=1)] | list[TokenId] | list[str] | list[list[TokenId]],
    WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1}, _TOKEN_IDS,
        {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "items": _TOKEN_IDS}]}),
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


class TextPart(StrictModel):
    """One part of a message's content (only text is supported)."""

    type: Literal["text"]
    text: str


class CalledFunction(StrictModel):
    """The function of a call an assistant made: its name and its arguments' JSON text."""

    name: str
    arguments: str


class ToolCall(StrictModel):
    """One call in an assistant message's `tool_calls`."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(StrictModel):
    """One message of a conversation: an assistant's may carry `tool_calls` (content null),
    a `tool` message answers the call named by its `tool_call_id`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The dict a chat template sees; calls' arguments as objects when they are JSON
        objects (as transformers' templates expect), else as the text given."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [{
                "id": call.id, "type": "function",
                "function": {"name": call.function.name,
                             "arguments": _json_object_or_text(call.function.arguments)},
            } for call in self.tool_calls]
        return message


def _json_object_or_text(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


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


class SessionCreateRequest(RequestBody):
    """`POST /v1/sessions`: a live session over a prompt (or a conversation)."""

    model: ModelName | None = None
    prompt: Annotated[str | list[TokenId] | None, WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1}, _TOKEN_IDS, {"type": "null"}]})] = None
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


# ---- OpenAI's Responses API (`POST /v1/responses`) ----------------------------------------

# Responses fields clients send that change nothing here: dropped with one logged warning.
# (`include` asks for extra output fields Loom does not produce; `truncation` "disabled" is
# Loom's behaviour, a prompt past the context is a 400.)
IGNORED_RESPONSE_FIELDS = frozenset({
    "service_tier", "safety_identifier", "prompt_cache_key", "include", "truncation",
    "user", "reasoning", "stream_options", "top_logprobs", "prompt_cache_retention",
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


class ResponseNamedToolChoice(StrictModel):
    """`tool_choice: {"type": "function", "name": ...}`."""

    type: Literal["function"]
    name: str = Field(json_schema_extra={"pattern": _FUNCTION_NAME})


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
