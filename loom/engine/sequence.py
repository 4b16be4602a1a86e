"""`SequenceState`: what the engine tracks per sequence beyond the scheduler's `Request`.

Sampling parameters, the seeded generator, the detokenizer, stop checks and the pieces of
the output. Tokens after the original prompt are of two kinds: generated (sampled here) and
appended (fragments given by a caller); both are in `output_token_ids` and in `text`, but
only the generated tokens of the current segment count for `max_tokens`, `min_tokens` and
stop strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loom.core.request import Request
from loom.engine.outputs import CompletionOutput, PositionLogprobs
from loom.sample import make_generator
from loom.sampling_params import SamplingParams
from loom.tokenizer import IncrementalDetokenizer, StopStringChecker


@dataclass
class SequenceState:
    """Engine-side state of one sequence (one of the `n` of a request, or a session)."""

    request: Request
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    group_id: str = ""
    index: int = 0
    prompt: str | None = None
    generator: torch.Generator | None = None
    is_session: bool = False
    generating: bool = True
    output_token_ids: list[int] = field(default_factory=list)
    segment_token_ids: list[int] = field(default_factory=list)
    segment_text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Last logits row (float32, [V]) for the end of the computed tokens, kept for sessions.
    last_logits: torch.Tensor | None = None
    stop_checker: StopStringChecker | None = None
    # Text returned to the caller at the end of a segment: truncated at a stop string.
    text_cut: int | None = None
    # Characters of text the last sampled token added (where a stop string may end).
    last_delta_len: int = 0
    # The request tree (sequence hooks): parent, children not joined yet, all children.
    parent_id: str | None = None
    depth: int = 0
    children: list[str] = field(default_factory=list)
    all_children: list[str] = field(default_factory=list)
    blocked: bool = False
    finish_requested: bool = False
    # Speculative decoding: most drafts to propose next (None: not drafted yet), and steps
    # to skip drafting after a miss (see loom.engine.speculation.Speculator.observe).
    draft_limit: int | None = None
    draft_pause: int = 0
    # Seconds a paused session may stay idle before it expires (None: the engine's default).
    ttl_s: float | None = None

    @property
    def request_id(self) -> str:
        """The scheduler's id of this sequence."""
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        """The tokens of the original prompt."""
        return self.request.token_ids[: self.request.num_prompt_tokens]

    def start_segment(self, params: SamplingParams, device: str) -> None:
        """Begin a generation segment with these parameters (a fresh seeded generator)."""
        self.params = params
        self.generating = True
        self.segment_token_ids = []
        self.segment_text = ""
        self.finish_reason = None
        self.stop_reason = None
        self.text_cut = None
        self.draft_limit, self.draft_pause = None, 0  # new parameters: drafting starts afresh
        self.stop_checker = (
            StopStringChecker(params.stop_strings, params.include_stop_str_in_output)
            if params.stop_strings
            else None
        )
        if params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        self.generator = (
            None if params.seed is None else make_generator(params.seed + self.index, device)
        )

    def append_fragment(self, token_ids: list[int]) -> None:
        """Record caller-appended tokens (already added to the request)."""
        self.output_token_ids.extend(token_ids)
        self.detokenizer.append_prompt(token_ids)

    def add_generated(self, token_id: int, logprob: float, top: PositionLogprobs | None) -> str:
        """Record one sampled token; returns the new text it produced."""
        self.output_token_ids.append(token_id)
        self.segment_token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if self.logprobs is not None:
            entry = {token_id: logprob}
            if top:
                entry.update(top)
            self.logprobs.append(entry)
        delta = self.detokenizer.add([token_id])
        self.segment_text += delta
        self.last_delta_len = len(delta)
        return delta

    def completion(self) -> CompletionOutput:
        """The vLLM-shaped view of this sequence now."""
        text = self.detokenizer.text
        if self.text_cut is not None:
            text = text[: self.text_cut]
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
