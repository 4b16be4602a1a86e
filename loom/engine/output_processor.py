"""`OutputProcessor`: a step's `RequestOutput`s, in the shape each request asked for.

Per request and step, by `SamplingParams.output_kind`:

- DELTA: what each sequence produced since its previous output (new token ids, their
  logprobs, the text they completed, the finish reason once). Host work is O(new tokens),
  whatever the context length; a step where a sequence produced nothing sends nothing
  unless the request finished.
- CUMULATIVE: everything after the prompt so far (a copy: O(output length) per step).
- FINAL_ONLY: one cumulative output when the request, or a session's segment, finishes.

Text is detokenised once (incrementally, on the sequence); a stop string is cut there and
the delta holds back the tail a stop string could still claim, so no consumer needs its own
hold-back. A request tree's children are reported (cumulatively) with the request's last
output, or with every output in CUMULATIVE mode.
"""

from __future__ import annotations

from loom.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from loom.engine.sequence import SequenceState
from loom.engine.sequence_table import SequenceTable
from loom.sampling_params import RequestOutputKind


class OutputProcessor:
    """Builds outputs from the sequence table."""

    def __init__(self, table: SequenceTable) -> None:
        self.table = table

    def group_output(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """The request's output now, or None when its kind has nothing to send."""
        seqs = self.table.group(request_id)
        finished = all(s.request.is_finished for s in seqs)
        roots = [s for s in seqs if s.parent_id is None]
        kind = roots[0].params.output_kind
        send_all = finished or error is not None
        if kind is RequestOutputKind.DELTA:
            completions = [_delta(s, send_all) for s in roots]
            if not send_all and not any(c is not None for c in completions):
                return None
            outputs = [c if c is not None else _empty(s) for c, s in zip(completions, roots,
                                                                         strict=True)]
        elif kind is RequestOutputKind.FINAL_ONLY:
            segment_done = all(s.finish_reason is not None and not s.finish_reported
                                for s in roots)
            if not (send_all or segment_done):
                return None
            for s in roots:
                s.finish_reported = s.finish_reason is not None
            outputs = [s.completion() for s in roots]
        else:
            outputs = [s.completion() for s in roots]
        out = RequestOutput(
            request_id=request_id,
            prompt=roots[0].prompt,
            prompt_token_ids=roots[0].prompt_token_ids,
            outputs=outputs,
            finished=finished,
            error=error,
            prompt_logprobs=_prompt_logprobs(roots[0], kind),
        )
        # Children go with a request's (or a session segment's) last output, and with every
        # cumulative one.
        if finished or out.segment_finished or kind is RequestOutputKind.CUMULATIVE:
            out.children = [c for s in roots for c in self.child_outputs(s)]
        return out

    def child_outputs(self, seq: SequenceState) -> list[RequestOutput]:
        """The output tree under a sequence (cumulative)."""
        outputs = []
        for child_id in seq.all_children:
            child = self.table[child_id]
            outputs.append(
                RequestOutput(
                    request_id=child_id,
                    prompt=None,
                    prompt_token_ids=child.prompt_token_ids,
                    outputs=[child.completion()],
                    finished=child.request.is_finished,
                    children=self.child_outputs(child),
                )
            )
        return outputs


def _delta(seq: SequenceState, force: bool) -> CompletionOutput | None:
    """The sequence's delta, or None when it has nothing new (and `force` is off). A finish
    reason is reported once, in the delta of the step the segment ended (or the next one)."""
    new_finish = seq.finish_reason is not None and not seq.finish_reported
    if not (force or new_finish or seq.delta_token_ids or seq.delta_text):
        return None
    out = seq.take_delta()
    if new_finish:
        seq.finish_reported = True
    else:
        out.finish_reason = out.stop_reason = None
    return out


def _empty(seq: SequenceState) -> CompletionOutput:
    return CompletionOutput(index=seq.index, text="", token_ids=[],
                            cumulative_logprob=seq.cumulative_logprob,
                            logprobs=[] if seq.logprobs is not None else None)


def _prompt_logprobs(seq: SequenceState, kind: RequestOutputKind
                     ) -> list[PositionLogprobs | None] | None:
    """The sequence's prompt logprobs once every prompt token has its entry (None before,
    and for delta outputs after the first that carried them)."""
    entries = seq.prompt_logprobs
    if entries is None or len(entries) < len(seq.prompt_ids):
        return None
    if kind is RequestOutputKind.DELTA:
        if seq.prompt_logprobs_reported:
            return None
        seq.prompt_logprobs_reported = True
    return entries
