"""The scheduler's view of a KV connector (torch-free), and range arithmetic for loads.

A connector finds K/V of a request's tokens in an external store. The scheduler asks it
once per admission (a new, preempted or woken request whose table ends on a block boundary
at its frontier), allocates blocks for the matched range, and lets the runner load them in
the next step while the request waits. The store may lack some blocks inside the range
(gaps): those, and blocks whose load fails, are computed like any uncomputed tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from loom.core.request import Request

Range = tuple[int, int]


class SchedulerConnector(Protocol):
    """The scheduler side of a KV connector (vLLM V1's method names)."""

    load_failure_policy: str  # "recompute" or "fail"

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens after `num_computed_tokens` whose K/V the store can supply (a whole number
        of blocks, never the request's last token), and whether the load is asynchronous."""
        ...

    def update_state_after_alloc(
        self, request: Request, blocks: list[int], num_external_tokens: int
    ) -> None:
        """Blocks now hold slots for the matched tokens: remember what to load into them."""
        ...

    def get_computed_token_gaps(self, request: Request) -> list[Range] | None:
        """Ranges inside the matched tokens that the store cannot supply (None: no gaps)."""
        ...

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """What the worker side needs for this step (loads, saves); resets per-step state."""
        ...

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request ends; True would ask the scheduler to keep its blocks for a save."""
        ...


@dataclass(frozen=True)
class LoadFailure:
    """A request whose external load failed under `kv_load_failure_policy="fail"`."""

    request_id: str
    message: str


def subtract_ranges(ranges: Sequence[Range], holes: Sequence[Range]) -> list[Range]:
    """`ranges` minus `holes`, as sorted disjoint [start, end) ranges.

        ranges: [0 ................ 12)    holes: [2, 4) [6, 9)
        result: [0, 2) [4, 6) [9, 12)
    """
    out: list[Range] = []
    for start, end in ranges:
        for h_start, h_end in sorted(holes):
            if h_end <= start or h_start >= end:
                continue
            if h_start > start:
                out.append((start, h_start))
            start = max(start, h_end)
        if start < end:
            out.append((start, end))
    return out


def blocks_to_ranges(block_indices: Sequence[int], block_size: int) -> list[Range]:
    """Token ranges covered by table indices (merged where adjacent)."""
    out: list[Range] = []
    for index in sorted(block_indices):
        start, end = index * block_size, (index + 1) * block_size
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def widen_to_blocks(ranges: Sequence[Range], block_size: int) -> list[Range]:
    """Round each range outward to whole blocks (a partly missing block is computed whole)."""
    indices = {
        i for start, end in ranges if end > start
        for i in range(start // block_size, -(-end // block_size))
    }
    return blocks_to_ranges(sorted(indices), block_size)
