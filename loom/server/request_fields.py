"""Field groups that several generating request bodies share: sampling (OpenAI's names and
vLLM's extras), stream options, and constraints on the output's language."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema, model_validator

from loom.errors import InvalidSamplingParamsError
from loom.sampling_params import SamplingParams
from loom.server.request_base import (
    LIMIT,
    MaxTokens,
    NonNegInt,
    StrictModel,
    without_ignored_fields,
)

# A token id as a JSON object's key (logit_bias): digits naming an id below the vocabulary.
_TOKEN_ID_KEY = {"type": "string", "pattern": r"^\s*[0-9]+\s*$", LIMIT: "token_id_key"}

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
