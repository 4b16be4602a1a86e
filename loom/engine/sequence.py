"""`SequenceState`: what the engine tracks per sequence beyond the scheduler's `Request`.

Sampling parameters, the seeded generator, the detokenizer, stop checks, the tree links and
what the sequence produced since its last output. Tokens after the original prompt are of
three kinds:

- generated: sampled by the engine;
- produced by a hook (a `<sync>` join's merged text, an async call's result): part of the
  request's output, like generated tokens, but not counted by `max_tokens`;
- appended by a caller (a session fragment): input, not output.

All three are in `output_token_ids` and the cumulative `text`. Deltas (`take_delta`) carry
only the first two, so a segment's concatenated deltas are exactly what it produced whatever
a caller appends meanwhile. Only the generated tokens of the current segment count for
`max_tokens`, `min_tokens` and stop strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loom.core.request import Request, RequestStatus
from loom.engine.outputs import CompletionOutput, PositionLogprobs
from loom.engine.structured_output import GrammarMatcher
from loom.sample import make_generator
from loom.sampling_params import RequestOutputKind, SamplingParams
from loom.tokenizer import IncrementalDetokenizer, StopStringChecker


@dataclass
class SequenceState:
    """Engine-side state of one sequence (one of the `n` of a request, a session, or a child
    in a request tree)."""

    request: Request
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    group_id: str = ""
    index: int = 0
    prompt: str | None = None
    generator: torch.Generator | None = None
    is_session: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    segment_token_ids: list[int] = field(default_factory=list)
    # Generated text of the current segment; kept only when the segment has stop strings
    # (they are searched in it), else only its length counts.
    segment_text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Whether an output already told the caller that the current segment finished.
    finish_reported: bool = False
    # When the current segment started (a request was added, a session's segment began), on
    # the table's clock (`SequenceTable.clock`); set only by `start_segment`.
    segment_started: float = 0.0
    # Last logits row (float32, [V]) for the end of the computed tokens, kept for sessions;
    # for a plain request, the row at the end of its last appended fragment (the seed's
    # "prefill, then resample"), kept when `keep_prefill_logits` asks for it.
    last_logits: torch.Tensor | None = None
    keep_prefill_logits: bool = False
    stop_checker: StopStringChecker | None = None
    # Characters cut from the end of the output text by a stop string (the segment's end).
    text_cut_chars: int = 0
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
    # Characters of text the last sampled token added (where a stop string may end).
    last_delta_len: int = 0
    # Produced since the last delta output (see `take_delta`), kept only while the segment's
    # outputs are deltas; `delta_text` may hold back the tail a stop string could claim.
    streams_deltas: bool = False
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[PositionLogprobs] = field(default_factory=list)
    delta_text: str = ""
    # The structured-output matcher of the current constraint (None: unconstrained).
    grammar: GrammarMatcher | None = None
    # The original prompt's tokens, copied once (outputs refer to this list, never copy it).
    prompt_ids: list[int] = field(default_factory=list)
    # Prompt logprobs (params.prompt_logprobs): None for the first token, then one entry per
    # prompt token as its chunk is computed; whether an output carried them (deltas: once).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_reported: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            self.prompt_ids = self.request.token_ids[: self.request.num_prompt_tokens]

    @property
    def request_id(self) -> str:
        """The scheduler's id of this sequence."""
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        """The tokens of the original prompt (shared: do not modify)."""
        return self.prompt_ids

    @property
    def generating(self) -> bool:
        """Whether reaching the end of the tokens samples a token (a segment is under way).

        One flag with the scheduler's `Request.sample_when_computed`: it is that field."""
        return self.request.sample_when_computed

    @generating.setter
    def generating(self, value: bool) -> None:
        self.request.sample_when_computed = value

    def start_segment(self, params: SamplingParams, device: str, started: float) -> None:
        """Begin a generation segment at time `started` with these parameters (fresh seeds)."""
        self.params = params
        self.segment_started = started
        self.generating = True
        self.segment_token_ids = []
        self.segment_text = ""
        self.finish_reason = None
        self.stop_reason = None
        self.finish_reported = False
        self.text_cut_chars = 0
        self.streams_deltas = params.output_kind is RequestOutputKind.DELTA
        self.clear_delta()
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

    def end_segment(self, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """The current segment stopped with this terminal status (its `finish_reason` is the
        status's: one vocabulary); the table settles the request."""
        self.finish_reason = status.finish_reason
        self.stop_reason = stop_reason

    def append_input(self, token_ids: list[int]) -> None:
        """Record caller-appended tokens (already added to the request): not output."""
        self.output_token_ids.extend(token_ids)
        self.detokenizer.append_prompt(token_ids)

    def append_produced(self, token_ids: list[int]) -> None:
        """Record tokens a hook appended (already added to the request): they are output."""
        self.output_token_ids.extend(token_ids)
        text = self.detokenizer.append_prompt(token_ids)
        if self.streams_deltas:
            self.delta_token_ids.extend(token_ids)
            self.delta_text += text

    def add_generated(self, token_id: int, logprob: float, top: PositionLogprobs | None) -> str:
        """Record one sampled token; returns the new text it produced."""
        self.output_token_ids.append(token_id)
        self.segment_token_ids.append(token_id)
        self.cumulative_logprob += logprob
        entry = None
        if self.logprobs is not None:
            entry = {token_id: logprob}
            if top:
                entry.update(top)
            self.logprobs.append(entry)
        delta = self.detokenizer.add([token_id])
        if self.stop_checker is not None:
            self.segment_text += delta
        self.last_delta_len = len(delta)
        if self.streams_deltas:
            self.delta_token_ids.append(token_id)
            if entry is not None:
                self.delta_logprobs.append(entry)
            self.delta_text += delta
        return delta

    def cut_text(self, num_chars: int) -> None:
        """Drop the last `num_chars` characters of output text (a stop string and what
        followed it). A delta stream still holds them all in `delta_text`: it holds back
        the longest stop string's length - 1, and the rest came with this token."""
        self.text_cut_chars = num_chars
        if num_chars and self.streams_deltas:
            self.delta_text = self.delta_text[:-num_chars]

    @property
    def holdback_chars(self) -> int:
        """Trailing characters a delta keeps back while the segment runs: the start of a
        stop string that the next tokens may complete (and the engine would then cut)."""
        if self.stop_checker is None or self.finish_reason is not None:
            return 0
        return self.stop_checker.max_stop_len - 1

    def completion(self) -> CompletionOutput:
        """Everything after the prompt so far (a copy; O(output length))."""
        text = self.detokenizer.text
        if self.text_cut_chars:
            text = text[: len(text) - self.text_cut_chars]
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def take_delta(self) -> CompletionOutput:
        """What the sequence produced since its previous delta (O(new tokens)); the text's
        held-back tail waits for the next one."""
        text = self.delta_text
        split = max(0, len(text) - self.holdback_chars)
        released, self.delta_text = text[:split], text[split:]
        out = CompletionOutput(
            index=self.index,
            text=released,
            token_ids=self.delta_token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.delta_logprobs if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        self.delta_token_ids, self.delta_logprobs = [], []
        return out

    def clear_delta(self) -> None:
        """Forget what was produced since the last delta (a new segment starts after it)."""
        self.delta_token_ids, self.delta_logprobs, self.delta_text = [], [], ""
