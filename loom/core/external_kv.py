"""`ExternalKV`: the scheduler's part that asks a KV connector for K/V and settles loads.

    admission:   [ computed | local prefix cache | external match .............. | rest ]
                                                 [ ready | gap | ready | gap | ready ]
    load step:   the runner loads the ready ranges; the request computes nothing
    after it:    ranges whose load failed become gaps ("recompute") or fail the request
    later steps: the frontier computes each gap in order and jumps over each ready range

Gaps are uncomputed tokens like any other: the scheduler's rule (compute from the frontier
up to `Request.computable_end`) schedules them, chunked by the budget, batched with others.

The connector may be a user's class, and any of its methods may raise. A raise is a fault of
the request(s) the call concerns, never of the step: a match that raises is no match (the
request computes everything); a raise while planning a request's load (after its blocks were
allocated) fails that load, and one in `build_connector_meta` fails every load of the step,
both settled like failed blocks under `kv_load_failure_policy`; one in `request_finished` is
logged and the blocks are freed anyway. Each fault is logged once, with the exception.
"""

from __future__ import annotations

import logging

from loom.core.kv_cache_manager import KVCacheManager
from loom.core.kv_transfer import (
    LoadFailure,
    Range,
    SchedulerConnector,
    blocks_to_ranges,
    subtract_ranges,
    widen_to_blocks,
)
from loom.core.request import Request
from loom.core.scheduler_output import FilledBlock, SchedulerOutput

logger = logging.getLogger(__name__)


def _fault(method: str, error: Exception) -> str:
    """Why a connector call failed, as settled loads and logs name it."""
    return f"the connector's {method} raised {type(error).__name__}: {error}"


class ExternalKV:
    """Matches, starts and settles external loads; counts their tokens."""

    def __init__(self, connector: SchedulerConnector, kv: KVCacheManager) -> None:
        self.connector = connector
        self.kv = kv
        self.block_size = kv.block_size
        # In tokens: loaded from the store, computed in its gaps (missing blocks and failed
        # loads), and those of them whose load failed.
        self.num_loaded_tokens = 0
        self.num_gap_tokens = 0
        self.num_load_failed_tokens = 0

    def match(self, request: Request, start: int, num_table_blocks: int) -> int:
        """Tokens after `start` (the frontier past local cache hits) that the store holds; 0
        when the request's table (`num_table_blocks` with the hits) does not end exactly at
        `start` on a block boundary, or drafts are pending, or the connector raised or
        answered outside its contract (logged: the request computes those tokens)."""
        size = self.block_size
        if request.num_draft_tokens or start % size or num_table_blocks * size != start:
            return 0
        if request.computes_whole_prompt and start < request.num_prompt_tokens:
            return 0  # every prompt row is wanted (logits, mean pooling): computed, not loaded
        try:
            num_external, _ = self.connector.get_num_new_matched_tokens(request, start)
        except Exception as error:  # a user's connector: no hit, the request computes
            logger.warning("request %r: %s; computing its tokens instead",
                           request.request_id, _fault("get_num_new_matched_tokens", error))
            return 0
        num_external = num_external or 0
        last_allowed = (request.num_tokens - 1) // size * size  # the last token is computed
        if (not isinstance(num_external, int) or num_external < 0 or num_external % size
                or start + num_external > last_allowed):
            logger.warning(
                "request %r: the connector matched %r tokens after %d; it must match whole "
                "blocks of %d and leave the last of %d tokens to compute; computing them "
                "instead", request.request_id, num_external, start, size, request.num_tokens)
            return 0
        return num_external

    def start_load(self, request: Request, num_external: int, out: SchedulerOutput) -> None:
        """The request's blocks hold slots for `num_external` matched tokens after its
        frontier: the runner loads all but the connector's gaps in this step.

        A connector that raises here fails the whole load (`out.failed_load_plans`): the
        request still waits this step, and is settled after it like any failed load."""
        start = request.num_computed_tokens
        end = start + num_external
        gaps: list[Range] = []  # stays empty when the connector raises: all blocks fail
        method = "update_state_after_alloc"
        try:
            self.connector.update_state_after_alloc(
                request, self.kv.block_ids(request.request_id), num_external
            )
            method = "get_computed_token_gaps"
            gaps = widen_to_blocks(self.connector.get_computed_token_gaps(request) or [],
                                   self.block_size)
        except Exception as error:
            cause = _fault(method, error)
            logger.warning("request %r: %s; its load fails", request.request_id, cause)
            out.failed_load_plans[request.request_id] = cause
        request.ready_ranges = subtract_ranges([(start, end)], gaps)
        request.external_end = end
        request.loading_kv = True
        out.loading_request_ids.append(request.request_id)

    def build_meta(self, out: SchedulerOutput) -> None:
        """Set the step's connector metadata. A connector that raises fails every load
        planned in this step (the worker gets no metadata: nothing loads, nothing saves)."""
        try:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        except Exception as error:
            cause = _fault("build_connector_meta", error)
            logger.warning("%s; this step's loads (%d requests) fail and it saves nothing",
                           cause, len(out.loading_request_ids))
            out.kv_connector_metadata = None
            for request_id in out.loading_request_ids:
                out.failed_load_plans.setdefault(request_id, cause)

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        """Tell the connector the request ends (its blocks are freed right after, whatever
        the connector does or raises)."""
        try:
            self.connector.request_finished(request, block_ids)
        except Exception as error:
            logger.warning("request %r: %s; its blocks are freed anyway", request.request_id,
                           _fault("request_finished", error))

    def finish_load(
        self, request: Request, load_errors: dict[int, str], out: SchedulerOutput,
        load_failure: str | None = None,
    ) -> None:
        """The load ran: blocks that failed become gaps ("recompute"), or the request is
        reported for the engine to fail ("fail"); the frontier then skips what arrived.
        `load_failure`: the whole load failed for this reason (every block failed)."""
        request.loading_kv = False
        size = self.block_size
        table = self.kv.block_ids(request.request_id)
        loaded = [i for a, b in request.ready_ranges for i in range(a // size, b // size)]
        if load_failure is not None:
            load_errors = {table[i]: load_failure for i in loaded}
        failed = [i for i in loaded if table[i] in load_errors]
        self.num_load_failed_tokens += len(failed) * size
        if failed and self.connector.load_failure_policy == "fail":
            i = failed[0]
            out.load_failures.append(LoadFailure(
                request.request_id,
                f"request {request.request_id!r}: loading the KV of tokens "
                f"[{i * size}, {(i + 1) * size}) (block {table[i]}) failed: "
                f"{load_errors[table[i]]}",
            ))
            return
        self.num_loaded_tokens += (len(loaded) - len(failed)) * size
        request.num_cached_tokens += (len(loaded) - len(failed)) * size
        request.ready_ranges = subtract_ranges(request.ready_ranges,
                                               blocks_to_ranges(failed, size))
        request.advance_frontier(request.num_computed_tokens)  # skips a range at the frontier

    def fill_blocks(self, out: SchedulerOutput, requests: dict[str, Request]) -> None:
        """List in `out.filled_blocks` the blocks each chunk completes (all their tokens
        computed, drafts excluded) with their keys, for the connector to save after the
        forward.

            chunk:  [start ............ end - drafts)
            blocks:   | b completes |   | b completes |  (b = start // B ... (end - d) // B - 1)
        """
        size = self.block_size
        for chunk in out.chunks:
            request = requests[chunk.request_id]
            first, last = chunk.start_pos // size, (chunk.end_pos - chunk.num_draft_tokens) // size
            if last <= first:
                continue
            hashes = self.kv.block_hashes(request, last)
            out.filled_blocks.extend(
                FilledBlock(request.request_id, i, chunk.block_ids[i], hashes[i])
                for i in range(first, last)
            )
