"""Why a generation segment ends: EOS, stop token, stop string, max_tokens, context limit."""

from __future__ import annotations

from loom.core.request import RequestStatus
from loom.engine.sequence import SequenceState

Stop = tuple[RequestStatus, int | str | None]


def check_stop(
    seq: SequenceState, token_id: int, eos_token_ids: set[int], max_model_len: int
) -> Stop | None:
    """(the terminal status, the stop reason: the stop token or string) the last sampled
    token causes, or None to keep generating. A stop string cuts the output text where it
    ends. Checks run in vLLM's order: stop token, stop string, length.
    """
    params = seq.params
    num_generated = len(seq.segment_token_ids)
    if num_generated >= params.min_tokens:
        if token_id in eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED, None
        if params.stop_token_ids and token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
        if seq.stop_checker is not None:
            hit = seq.stop_checker.check(seq.segment_text, seq.last_delta_len)
            if hit is not None:
                kept_len, stop_str = hit
                seq.cut_text(len(seq.segment_text) - kept_len)
                return RequestStatus.FINISHED_STOPPED, stop_str
    if params.max_tokens is not None and num_generated >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    if seq.request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None

