"""Output objects in vLLM's shape: `RequestOutput` holding `CompletionOutput`s, whose
logprobs are `Logprob`s (floats with vLLM's `.logprob`, `.rank` and `.decoded_token`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loom.sample.logprob import Logprob

__all__ = ["CompletionOutput", "Logprob", "OutputAccumulator", "PositionLogprobs",
           "RequestOutput", "fill_decoded_tokens"]

# One position's logprobs: token id -> Logprob (the sampled or prompt token plus the top-N).
PositionLogprobs = dict[int, Logprob]


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
    # With SamplingParams.prompt_logprobs, once the prompt is computed (vLLM's shape): per
    # prompt position, None for the first, else {token id: logprob} holding the prompt's
    # token and the most likely ones. Delta outputs carry it once.
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def segment_finished(self) -> bool:
        """True when every sequence's current generation segment has stopped."""
        return all(o.finished for o in self.outputs)


class OutputAccumulator:
    """Folds one request's DELTA outputs into its cumulative output, in O(new tokens) per
    delta (text pieces are joined once, by `result`)."""

    def __init__(self) -> None:
        self._last: RequestOutput | None = None
        self._tokens: dict[int, list[int]] = {}
        self._texts: dict[int, list[str]] = {}
        self._logprobs: dict[int, list[PositionLogprobs] | None] = {}
        self._final: dict[int, CompletionOutput] = {}
        self._finish: dict[int, tuple[str, int | str | None]] = {}
        self._prompt_logprobs: list[PositionLogprobs | None] | None = None

    def add(self, delta: RequestOutput) -> None:
        """Take the next output of the request."""
        self._last = delta
        if delta.prompt_logprobs is not None:  # deltas carry them once
            self._prompt_logprobs = delta.prompt_logprobs
        for c in delta.outputs:
            self._tokens.setdefault(c.index, []).extend(c.token_ids)
            self._texts.setdefault(c.index, []).append(c.text)
            if c.logprobs is None:
                self._logprobs.setdefault(c.index, None)
            else:
                gathered = self._logprobs.get(c.index)
                if gathered is None:
                    gathered = self._logprobs[c.index] = []
                gathered.extend(c.logprobs)
            self._final[c.index] = c
            if c.finish_reason is not None:  # a delta reports a finish once
                self._finish[c.index] = (c.finish_reason, c.stop_reason)

    @property
    def has_output(self) -> bool:
        """Whether any output was added."""
        return self._last is not None

    @property
    def num_tokens(self) -> int:
        """Tokens gathered so far, over every sequence."""
        return sum(len(t) for t in self._tokens.values())

    def result(self) -> RequestOutput:
        """The cumulative output: everything the deltas carried, with the last one's
        finish reasons, flags, error and children."""
        last = self._last
        assert last is not None, "no output was added"
        outputs = []
        for index in sorted(self._final):
            final = self._final[index]
            finish_reason, stop_reason = self._finish.get(index, (None, None))
            outputs.append(CompletionOutput(
                index=index,
                text="".join(self._texts[index]),
                token_ids=list(self._tokens[index]),
                cumulative_logprob=final.cumulative_logprob,
                logprobs=self._logprobs.get(index),
                finish_reason=finish_reason,
                stop_reason=stop_reason,
            ))
        return RequestOutput(
            request_id=last.request_id,
            prompt=last.prompt,
            prompt_token_ids=last.prompt_token_ids,
            outputs=outputs,
            finished=last.finished,
            metrics=last.metrics,
            error=last.error,
            children=last.children,
            prompt_logprobs=self._prompt_logprobs,
        )


def fill_decoded_tokens(outputs: Sequence[object], decode: Callable[[int], str]) -> None:
    """Set `decoded_token` on the outputs' `Logprob`s that have none (children included;
    outputs other than `RequestOutput`s, embeddings, have none)."""
    for out in outputs:
        if not isinstance(out, RequestOutput):
            continue
        _fill_positions(out.prompt_logprobs, decode)
        for completion in out.outputs:
            _fill_positions(completion.logprobs, decode)
        fill_decoded_tokens(out.children, decode)


def _fill_positions(positions: Sequence[PositionLogprobs | None] | None,
                    decode: Callable[[int], str]) -> None:
    """Newest positions first, stopping at one already decoded: positions are filled in
    order by the steps that report them, so everything before a filled one is filled too
    (a cumulative output costs only its new positions)."""
    for position in reversed(positions or ()):
        if position is None:  # the prompt's first token has no logprob
            continue
        missing = [(token_id, lp) for token_id, lp in position.items()
                   if isinstance(lp, Logprob) and lp.decoded_token is None]
        if not missing:
            return
        for token_id, lp in missing:
            lp.decoded_token = decode(token_id)
