"""`LoomRequestRouter`: Ray Serve's request router for engine replicas.

Ray Serve builds one router per deployment handle, in the process that holds the handle
(a `RayEngineClient`), and asks it for a replica for every call. This one reads the call's
`route` keyword (`loom.distributed.routing.Route`) and decides with `RoutingPolicy`; each
replica's load is its routing statistics (`EngineReplica.record_routing_stats`: running and
waiting sequences). A call without a route goes to the least loaded replica.

The router also publishes the ids of the replicas Serve reports running (`running_replicas`),
so the client can address each live replica (readings) and tell a gone holder from a live
one without a round trip. Ray Serve pickles this module by value: it keeps no state of its
own (`loom.distributed.live` holds what clients read).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from loom.distributed.routing import Route, RoutingPolicy

logger = logging.getLogger(__name__)


def replica_load(stats: dict[str, Any] | None) -> int:
    """A replica's load in sequences from its routing statistics (0 before any)."""
    if not stats:
        return 0
    return int(stats.get("running", 0)) + int(stats.get("waiting", 0))


class LoomRequestRouter(RequestRouter):
    """Routes by `Route` (see `loom.distributed.routing`); configured through
    `RequestRouterConfig(request_router_kwargs={"imbalance_threshold": ...,
    "prefix_memory": ...})`."""

    def initialize_state(self, imbalance_threshold: int = 8, prefix_memory: int = 4096,
                         **_: Any) -> None:
        from loom.distributed.live import shared_policy

        self.policy = shared_policy(self._deployment_id.app_name, self._deployment_id.name,
                                    imbalance_threshold, prefix_memory)
        self._stats_seen: dict[str, int] = {}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ids = frozenset(r.replica_id.unique_id for r in replicas)
        policy = self._policy()
        for gone in set(self._stats_seen) - ids:
            policy.forget(gone)
            self._stats_seen.pop(gone, None)
        from loom.distributed.live import publish_running

        publish_running(self._deployment_id.app_name, self._deployment_id.name, id(self), ids)

    def _policy(self) -> RoutingPolicy:
        if not hasattr(self, "policy"):  # initialize_state not called (no kwargs given)
            self.initialize_state()
        return self.policy

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        policy = self._policy()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {}
        for rid, replica in by_id.items():
            stats = replica.routing_stats
            marker = id(stats)
            if self._stats_seen.get(rid) != marker:
                self._stats_seen[rid] = marker
                policy.stats_refreshed(rid)
            loads[rid] = replica_load(stats)
        route = None
        if pending_request is not None:
            route = pending_request.kwargs.get("route")
        decision = policy.choose(route if isinstance(route, Route) else Route(), loads)
        logger.debug("route %s, loads %s: %s", route, loads, decision)
        return [] if decision is None else [[by_id[decision.replica]]]
