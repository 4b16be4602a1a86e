"""Output objects in vLLM's shape: `RequestOutput` holding `CompletionOutput`s."""

from __future__ import annotations

from dataclasses import dataclass, field

# One position's logprobs: token id -> logprob (the sampled token plus the top-N).
PositionLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (there are `n` of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        """True once this sequence (or its current segment) stopped."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of a request after a step: prompt, outputs so far, and whether it is done.

    For a session, a generation segment that ends sets `outputs[i].finish_reason` while
    `finished` stays False: the request lives on, paused, with its KV cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    children: list[RequestOutput] = field(default_factory=list)

    @property
    def segment_finished(self) -> bool:
        """True when every sequence's current generation segment has stopped."""
        return all(o.finished for o in self.outputs)
