"""Which engine replica a call goes to: the pure decision, without Ray.

Every call a `RayEngineClient` makes carries a `Route`. The rules, in order:

1. `Route.replica` (a per-replica call: a reading, a drain) goes to that replica; if it is
   not running, to the least loaded one, which refuses the call (it checks the target).
2. `Route.holder` (the replica the directory pins the named request or session to) goes to
   that replica: a hard pin, never weighed against load. If the holder is not among the
   running replicas (killed, crashed, scaled down), the call goes to the least loaded
   other replica, which continues the session from the shared store or answers that it
   is lost; the decision says `moved`.
3. A new request (no holder) goes to the replica whose remembered block-hash chains match
   the longest prefix of the prompt's full blocks, unless that replica's load exceeds the
   least loaded one's by more than `imbalance_threshold` sequences; then, and when nothing
   matches, to the least loaded replica (ties broken at random).

A replica in `Route.avoid` (one a call just found dead) is never chosen while another runs.
The policy remembers, per replica, the block hashes of the prompts it sent there (an LRU
bounded by `prefix_memory` hashes per replica): the prefix cache that replica most likely
holds. Loads come from the replicas' routing statistics plus the new requests this policy
sent since they were measured.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

# The routing reasons a `Decision` names.
EXPLICIT, PINNED, MOVED, PREFIX, LEAST_LOADED = (
    "explicit", "pinned", "moved", "prefix", "least_loaded")


@dataclass(frozen=True)
class Route:
    """What a call tells the router: the id it names (a request or session; None for a
    new request without one yet), the replica pinned to it (None: new, or pin unknown), an
    explicit target replica, the chained hashes of the prompt's full blocks (new requests),
    and replicas to avoid. Travels as the `route` keyword of every replica call."""

    request: str | None = None
    holder: str | None = None
    replica: str | None = None
    prefix: tuple[bytes, ...] = ()
    avoid: tuple[str, ...] = ()


@dataclass(frozen=True)
class Decision:
    """The replica chosen and why (one of the reasons above); `matched` blocks of prefix."""

    replica: str
    reason: str
    matched: int = 0


class RoutingPolicy:
    """The routing rules of the module docstring over replica ids and their loads."""

    def __init__(self, imbalance_threshold: int = 8, prefix_memory: int = 4096,
                 rng: random.Random | None = None) -> None:
        if imbalance_threshold < 0 or prefix_memory < 1:
            raise ValueError("imbalance_threshold must be >= 0 and prefix_memory >= 1")
        self.imbalance_threshold = imbalance_threshold
        self.prefix_memory = prefix_memory
        self._rng = rng or random.Random()
        self._prefixes: dict[str, OrderedDict[bytes, None]] = {}
        self._sent: dict[str, int] = {}  # new requests sent since the replica's last stats

    # ---- what the policy learns ------------------------------------------------------

    def remember(self, replica: str, prefix: Sequence[bytes]) -> None:
        """Record that a prompt with these block hashes went to `replica`."""
        memory = self._prefixes.setdefault(replica, OrderedDict())
        for key in prefix:
            memory[key] = None
            memory.move_to_end(key)
        while len(memory) > self.prefix_memory:
            memory.popitem(last=False)

    def forget(self, replica: str) -> None:
        """Drop what is known of a replica that is gone."""
        self._prefixes.pop(replica, None)
        self._sent.pop(replica, None)

    def stats_refreshed(self, replica: str) -> None:
        """The replica's measured load now includes what was sent to it."""
        self._sent.pop(replica, None)

    def matched_blocks(self, replica: str, prefix: Sequence[bytes]) -> int:
        """How many leading blocks of `prefix` the replica was sent (chained hashes: block
        i matching implies blocks 0..i-1 matched when they were sent together)."""
        memory = self._prefixes.get(replica)
        if not memory:
            return 0
        n = 0
        for key in prefix:
            if key not in memory:
                break
            n += 1
        return n

    # ---- the decision ----------------------------------------------------------------

    def choose(self, route: Route, loads: Mapping[str, int]) -> Decision | None:
        """The replica for `route` among `loads` (running replica id -> measured load in
        sequences); None when no replica runs. A new request's choice is remembered."""
        if not loads:
            return None
        running = {r: load + self._sent.get(r, 0) for r, load in loads.items()}
        usable = {r: v for r, v in running.items() if r not in route.avoid} or running
        if route.replica is not None:
            if route.replica in running:
                return Decision(route.replica, EXPLICIT)
            return Decision(self._least_loaded(usable), EXPLICIT)
        if route.holder is not None:
            if route.holder in usable:
                return Decision(route.holder, PINNED)
            return self._sent_to(Decision(self._least_loaded(usable), MOVED), route)
        return self._sent_to(self._for_new(route.prefix, usable), route)

    def _for_new(self, prefix: Sequence[bytes], loads: Mapping[str, int]) -> Decision:
        least = self._least_loaded(loads)
        if prefix:
            matches = {r: self.matched_blocks(r, prefix) for r in loads}
            best = max(matches.values())
            if best > 0:
                ties = [r for r, m in matches.items() if m == best]
                chosen = self._least_loaded({r: loads[r] for r in ties})
                if loads[chosen] - loads[least] <= self.imbalance_threshold:
                    return Decision(chosen, PREFIX, best)
        return Decision(least, LEAST_LOADED)

    def _least_loaded(self, loads: Mapping[str, int]) -> str:
        low = min(loads.values())
        return self._rng.choice(sorted(r for r, v in loads.items() if v == low))

    def _sent_to(self, decision: Decision, route: Route) -> Decision:
        self._sent[decision.replica] = self._sent.get(decision.replica, 0) + 1
        if route.prefix:
            self.remember(decision.replica, route.prefix)
        return decision


def prefix_hashes(token_ids: Sequence[int], block_size: int) -> tuple[bytes, ...]:
    """The chained keys of the full blocks of `token_ids` (the prefix cache's keys)."""
    from loom.core.block_hash import extend_block_hashes

    return tuple(extend_block_hashes([], token_ids, block_size, len(token_ids) // block_size))


def running_only(loads: Mapping[str, int], running: Collection[str]) -> dict[str, int]:
    """`loads` restricted to the running replicas (a replica without stats counts 0)."""
    return {r: loads.get(r, 0) for r in running}
