"""`SegmentedPrefillExampleConnector`: a `SharedStorageConnector` that pretends parts of
every match are missing from the store, so that the engine must compute those parts itself
(segmented prefill) between the blocks it loads.

For a match of at least two blocks it picks gaps of 1, 2, 3 ... blocks, separated by loaded
runs of the same growing sizes, and never makes the last matched block a gap:

    matched blocks:  -E--EE---EEE   (- a gap: computed by the engine, E: loaded)

Decoding with it must give exactly the text a plain load gives; `run.sh` checks that.

Load it by module path (this folder must be importable, as it is for the scripts here):

    KVTransferConfig(kv_connector="SegmentedPrefillExampleConnector",
                     kv_connector_module_path="segmented_prefill_example_connector",
                     kv_role="kv_consumer",
                     kv_connector_extra_config={"shared_storage_path": "local_storage"})

Setting SEGMENTED_PREFILL_BREAK=1 makes the connector deliberately wrong, to show that the
checks catch it: it still skips loading the gap blocks but no longer tells the engine about
them, so those blocks are neither loaded nor computed.
"""

from __future__ import annotations

import os
from typing import Any

from loom.core.kv_transfer import Range, widen_to_blocks
from loom.core.request import Request
from loom.kv_connector import (
    KVCacheSpec,
    KVConnectorRole,
    KVTransferConfig,
    SharedStorageConnector,
)


def choose_gaps(first_block: int, end_block: int, block_size: int) -> list[Range]:
    """Token ranges of the gaps inside the matched blocks [first_block, end_block): a gap of
    1 block, a loaded run of 1, a gap of 2, a run of 2, ...; the last block always loads."""
    gaps: list[Range] = []
    block, size = first_block, 1
    while block < end_block - 1:
        gap_end = min(block + size, end_block - 1)
        gaps.append((block * block_size, gap_end * block_size))
        block = gap_end + size  # the loaded run after the gap is as long as the gap
        size += 1
    return gaps


def picture(num_computed: int, num_external: int, gaps: list[Range], block_size: int) -> str:
    """One character per block up to the end of the match: C already computed (local prefix
    cache), E loaded from the store, - a gap the engine computes."""
    chars = []
    for start in range(0, num_computed + num_external, block_size):
        if start < num_computed:
            chars.append("C")
        elif any(a <= start < b for a, b in gaps):
            chars.append("-")
        else:
            chars.append("E")
    return "".join(chars)


class SegmentedPrefillExampleConnector(SharedStorageConnector):
    """Blocks in a folder, like its parent, with simulated holes in every match."""

    def __init__(self, config: KVTransferConfig, spec: KVCacheSpec, role: KVConnectorRole):
        super().__init__(config, spec, role)
        self._gaps: dict[str, list[Range]] = {}  # request id -> gaps of its current match
        # Request id -> the gaps the engine was told to compute, for every request admitted
        # so far (decode_example.py compares their total with the engine's kv_gap_tokens).
        self.recorded_gaps: dict[str, list[Range]] = {}
        self.break_on_purpose = os.environ.get("SEGMENTED_PREFILL_BREAK") == "1"

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The parent's match, with simulated gaps chosen inside it."""
        num_external, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        num_external = num_external or 0
        # The scheduler may ask again (a request it could not admit yet): start afresh.
        self._gaps.pop(request.request_id, None)
        size = self.spec.block_size
        if num_external >= 2 * size:
            first = num_computed_tokens // size  # the scheduler asks on block boundaries
            chosen = choose_gaps(first, first + num_external // size, size)
            real = super().get_computed_token_gaps(request) or []  # blocks the store lacks
            self._gaps[request.request_id] = widen_to_blocks([*chosen, *real], size)
        return num_external, is_async

    def get_computed_token_gaps(self, request: Request) -> list[Range] | None:
        """The gaps of the request's match (the parent's own gaps included)."""
        gaps = self._gaps.get(request.request_id)
        if gaps is None:
            return super().get_computed_token_gaps(request)
        return list(gaps) or None

    def update_state_after_alloc(
        self, request: Request, blocks: list[int], num_external_tokens: int
    ) -> None:
        """The parent queues the loads (it skips our gaps); show the blocks of the request."""
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        gaps = self._gaps.get(request.request_id)
        if not gaps or not num_external_tokens:
            return
        size = self.spec.block_size
        num_computed = request.num_computed_tokens
        self.recorded_gaps[request.request_id] = list(gaps)
        num_gap_tokens = sum(b - a for a, b in gaps)
        print(
            f"[segmented prefill] {request.request_id}: "
            f"{picture(num_computed, num_external_tokens, gaps, size)} "
            f"(C computed, E loaded, - gap; blocks of {size}; {num_gap_tokens} gap tokens, "
            f"{request.num_tokens - num_computed - num_external_tokens} tokens after the match)",
            flush=True,
        )
        if self.break_on_purpose:
            # Wrong on purpose: the gap blocks were left out of the loads above, and now the
            # engine is told there are no gaps, so it never computes them either.
            self._gaps[request.request_id] = []

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request's current gaps (`recorded_gaps` keeps them)."""
        self._gaps.pop(request.request_id, None)
        return super().request_finished(request, block_ids)
