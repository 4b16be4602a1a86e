"""`ExternalKV`: the scheduler's part that asks a KV connector for K/V and settles loads.

    admission:   [ computed | local prefix cache | external match .............. | rest ]
                                                 [ ready | gap | ready | gap | ready ]
    load step:   the runner loads the ready ranges; the request computes nothing
    after it:    ranges whose load failed become gaps ("recompute") or fail the request
    later steps: the frontier computes each gap in order and jumps over each ready range

Gaps are uncomputed tokens like any other: the scheduler's rule (compute from the frontier
up to `Request.computable_end`) schedules them, chunked by the budget, batched with others.
"""

from __future__ import annotations

from loom.core.kv_cache_manager import KVCacheManager
from loom.core.kv_transfer import (
    LoadFailure,
    SchedulerConnector,
    blocks_to_ranges,
    subtract_ranges,
    widen_to_blocks,
)
from loom.core.request import Request
from loom.core.scheduler_output import FilledBlock, SchedulerOutput


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
        `start` on a block boundary, or drafts are pending."""
        size = self.block_size
        if request.num_draft_tokens or start % size or num_table_blocks * size != start:
            return 0
        num_external, _ = self.connector.get_num_new_matched_tokens(request, start)
        num_external = num_external or 0
        last_allowed = (request.num_tokens - 1) // size * size  # the last token is computed
        if num_external < 0 or num_external % size or start + num_external > last_allowed:
            raise ValueError(
                f"request {request.request_id}: the connector matched {num_external} tokens "
                f"after {start}; it must match whole blocks of {size} and leave the last "
                f"of {request.num_tokens} tokens to compute"
            )
        return num_external

    def start_load(self, request: Request, num_external: int, out: SchedulerOutput) -> None:
        """The request's blocks hold slots for `num_external` matched tokens after its
        frontier: the runner loads all but the connector's gaps in this step."""
        start = request.num_computed_tokens
        end = start + num_external
        self.connector.update_state_after_alloc(
            request, self.kv.block_ids(request.request_id), num_external
        )
        gaps = widen_to_blocks(self.connector.get_computed_token_gaps(request) or [],
                               self.block_size)
        request.ready_ranges = subtract_ranges([(start, end)], gaps)
        request.external_end = end
        request.loading_kv = True
        out.loading_request_ids.append(request.request_id)

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
