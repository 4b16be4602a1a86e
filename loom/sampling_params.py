"""`SamplingParams`: how to pick tokens and when to stop, per request (vLLM's field names)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from loom.errors import InvalidSamplingParamsError


class RequestOutputKind(Enum):
    """What a request's outputs hold (vLLM's names).

    CUMULATIVE: every output holds everything after the prompt so far (tokens, text,
    logprobs). DELTA: each output holds only what the sequence produced since the previous
    one; concatenated, the deltas give exactly what the request (or a session's segment)
    generated. FINAL_ONLY: one cumulative output when the request, or a session's segment,
    finishes."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True, eq=False)
class StructuredOutputsParams:
    """Constrain a generation to a language (vLLM's `structured_outputs`); exactly one of:

    `json`: a JSON schema (a dict or its JSON text); `json_object`: any JSON object;
    `regex`: a regular expression the whole output matches; `grammar`: a Lark grammar
    (llguidance's dialect: `start: ...`); `choice`: one of these strings.
    `whitespace_flexible`: JSON may carry whitespace between tokens (off: compact JSON, which
    small models cannot pad forever)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    whitespace_flexible: bool = False

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutputsParams) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __post_init__(self) -> None:
        given = [name for name, value in (("json", self.json), ("regex", self.regex),
                                          ("grammar", self.grammar), ("choice", self.choice))
                 if value is not None] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise InvalidSamplingParamsError(
                "invalid sampling parameter structured_outputs: give exactly one of json, "
                f"json_object, regex, grammar, choice (got {', '.join(given) or 'none'})")
        if self.choice is not None and (
                not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidSamplingParamsError(
                "invalid sampling parameter structured_outputs.choice: must be a non-empty "
                "list of non-empty strings")

    @property
    def key(self) -> str:
        """A text that names the constraint (equal constraints, equal keys)."""
        import json as _json

        return _json.dumps({"json": self.json, "json_object": self.json_object,
                            "regex": self.regex, "grammar": self.grammar,
                            "choice": self.choice, "ws": self.whitespace_flexible},
                           sort_keys=True, default=str)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping parameters of one request, validated on construction.

    temperature 0 means greedy. top_k <= 0 (or -1) and top_p == 1 and min_p == 0 disable
    those filters. Penalties follow vLLM: repetition_penalty over prompt and output tokens,
    presence and frequency penalties over output tokens only.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    # vLLM's prompt_logprobs: for every prompt token after the first, its logprob under the
    # logits of the position before it, with the `prompt_logprobs` most likely tokens there
    # (0: the prompt token's alone). Computed only when asked; such a request computes its
    # whole prompt (its blocks are cached for others, but it takes none from the cache).
    prompt_logprobs: int | None = None
    # vLLM's request priority: waiting work (new prompts, appended fragments) is admitted by
    # priority, lower first, then by arrival; a session's segment carries its own.
    priority: int = 0
    # OpenAI's logit_bias: token id -> a value in [-100, 100] added to its logit before
    # sampling (-100 in effect bans a token, 100 forces it); reported logprobs stay raw.
    logit_bias: dict[int, float] | None = None
    logits_processors: list[Any] | None = field(default=None, compare=False)
    # What each output of the request holds (vLLM's `output_kind`): everything so far, what
    # is new since the previous output, or one output when the request (or a session's
    # segment) finishes.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrain the output to a JSON schema, a regex, a grammar or a choice (see
    # StructuredOutputsParams); the engine masks every token the constraint forbids.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> InvalidSamplingParamsError:
            value = getattr(self, name)
            return InvalidSamplingParamsError(f"invalid sampling parameter {name}={value!r}: {why}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or (self.top_k < -1):
            raise bad("top_k", "must be an integer: -1 or 0 to disable, or >= 1")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not 0.01 <= self.repetition_penalty <= 100:
            raise bad("repetition_penalty", "must be in [0.01, 100] (1 disables it)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "must be an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0 or None")
        if not isinstance(self.priority, int):
            raise bad("priority", "must be an integer")
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", "must be an integer >= 0 or None")
        if self.stop is not None and any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if self.stop_token_ids is not None and any(
            not isinstance(t, int) or t < 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias is not None and (
            not isinstance(self.logit_bias, dict)
            or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                   for t in self.logit_bias)
            or any(isinstance(v, bool) or not isinstance(v, int | float) or not -100 <= v <= 100
                   for v in self.logit_bias.values())
        ):
            raise bad("logit_bias", "must map token ids (integers >= 0) to values in [-100, 100]")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "must be a RequestOutputKind")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63 - 1024
        ):
            raise bad("seed", "must be an integer in [-2**63, 2**63 - 1024) or None")

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list (possibly empty)."""
        return list(self.stop or [])

    def with_updates(self, **changes: Any) -> SamplingParams:
        """A validated copy with some fields changed."""
        return replace(self, **changes)
