"""Why a generation segment ends: EOS, stop token, stop string, max_tokens, context limit."""

from __future__ import annotations

from loom.core.request import RequestStatus
from loom.engine.sequence import SequenceState


def check_stop(
    seq: SequenceState, token_id: int, eos_token_ids: set[int], max_model_len: int
) -> RequestStatus | None:
    """The terminal status the last sampled token causes, or None to keep generating.

    Sets `seq.finish_reason`, `seq.stop_reason` and, for a stop string, cuts the output text
    where it ends. Checks run in vLLM's order: stop token, stop string, length.
    """
    params = seq.params
    num_generated = len(seq.segment_token_ids)
    if num_generated >= params.min_tokens:
        if token_id in eos_token_ids and not params.ignore_eos:
            return _stopped(seq, "stop", None, RequestStatus.FINISHED_STOPPED)
        if params.stop_token_ids and token_id in params.stop_token_ids:
            return _stopped(seq, "stop", token_id, RequestStatus.FINISHED_STOPPED)
        if seq.stop_checker is not None:
            hit = seq.stop_checker.check(seq.segment_text, seq.last_delta_len)
            if hit is not None:
                kept_len, stop_str = hit
                seq.cut_text(len(seq.segment_text) - kept_len)
                return _stopped(seq, "stop", stop_str, RequestStatus.FINISHED_STOPPED)
    if params.max_tokens is not None and num_generated >= params.max_tokens:
        return _stopped(seq, "length", None, RequestStatus.FINISHED_LENGTH)
    if seq.request.num_tokens >= max_model_len:
        return _stopped(seq, "length", None, RequestStatus.FINISHED_LENGTH)
    return None


def _stopped(
    seq: SequenceState, reason: str, stop_reason: int | str | None, status: RequestStatus
) -> RequestStatus:
    seq.end_segment(reason, stop_reason)
    return status
