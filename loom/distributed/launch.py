"""`start_replicas`: N engine replicas on Ray Serve, and the `RayEngineClient` over them.

Joins a Ray cluster (`ray_address`) or starts a local instance (every usable core), starts
Serve without its HTTP proxy (the OpenAI server is Loom's own, talking to the handle),
creates the application's session directory, and deploys `EngineReplica` with Loom's
request router. Each replica gets `threads` compute threads (default: the host's cores
split over the replicas, at least 1), as its torch thread count and `OMP_NUM_THREADS`.
`RayEngineClient.shutdown()` deletes the application and its directory, and stops Ray only
if this call started it. `router="power_of_two"` deploys with Ray Serve's default router
instead (power of two choices; for comparison: calls still carry their `Route`, but nothing
honours pins or prefixes, and the client's `running_replicas()` stays empty).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from loom.distributed.directory import Pins, directory_actor
from loom.distributed.live import wait_for_running
from loom.distributed.ray_client import RayEngineClient
from loom.distributed.replica import EngineReplica
from loom.distributed.router import LoomRequestRouter
from loom.engine.config import EngineArgs
from loom.errors import MissingDependencyError, ReplicaUnavailableError

logger = logging.getLogger(__name__)

DEPLOYMENT = "LoomEngine"
DEFAULT_APP = "loom"
# Ray Serve's per-replica concurrency cap: every live stream holds a slot, so it is high.
MAX_ONGOING_REQUESTS = 1000
# How often replicas report their load to the routers.
ROUTING_STATS_PERIOD_S = 0.5
# `start_replicas(router=...)`: Loom's request router, or Ray Serve's default.
ROUTERS = ("loom", "power_of_two")


def engine_deployment(replicas: int, threads: int, *, num_cpus: float | None = None,
                      imbalance_threshold: int = 8,
                      graceful_shutdown_timeout_s: float = 30.0, router: str = "loom") -> Any:
    """`EngineReplica` as a Serve deployment of `replicas` replicas with Loom's router (or,
    `router="power_of_two"`, Serve's default), each reserving `num_cpus` of Ray's CPUs
    (default: `threads`)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    routing = {} if router == "power_of_two" else {"request_router_config": RequestRouterConfig(
        request_router_class=f"{LoomRequestRouter.__module__}.{LoomRequestRouter.__qualname__}",
        request_router_kwargs={"imbalance_threshold": imbalance_threshold},
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        request_routing_stats_timeout_s=5.0,
    )}
    return serve.deployment(
        EngineReplica, name=DEPLOYMENT, num_replicas=replicas,
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        graceful_shutdown_timeout_s=graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=0.5,
        ray_actor_options={"num_cpus": threads if num_cpus is None else num_cpus, "runtime_env": {
            "env_vars": {"OMP_NUM_THREADS": str(threads)}}},
        **routing,
    )


def start_replicas(engine_args: EngineArgs, replicas: int, ray_address: str | None = None,
                   *, app_name: str = DEFAULT_APP, threads: int | None = None,
                   num_cpus: float | None = None,
                   imbalance_threshold: int = 8, graceful_shutdown_timeout_s: float = 30.0,
                   start_timeout_s: float = 600.0, router: str = "loom") -> RayEngineClient:
    """Deploy `replicas` engines and return the client over them (see the module
    docstring). `threads`: compute threads per replica (default: the cores / replicas);
    `num_cpus`: Ray CPUs each replica reserves (default: `threads`); `router`: "loom" or
    "power_of_two" (Serve's default router)."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, not {router!r}")
    try:
        import ray
        from ray import serve
    except ImportError:
        raise MissingDependencyError(
            "--replicas needs Ray Serve: pip install 'loom-llm[ray]'") from None
    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    started_ray = False
    if not ray.is_initialized():
        if ray_address is None:
            cores = len(os.sched_getaffinity(0))
            ray.init(num_cpus=max(cores, replicas), include_dashboard=False,
                     log_to_driver=False)
        else:
            ray.init(address=ray_address, log_to_driver=False)
        started_ray = True
    if threads is None:
        cores = int(ray.cluster_resources().get("CPU", len(os.sched_getaffinity(0))))
        threads = max(1, cores // replicas)
    from ray.serve.config import ProxyLocation

    serve.start(proxy_location=ProxyLocation.Disabled)
    directory = directory_actor(app_name)
    began = time.monotonic()
    deployment = engine_deployment(replicas, threads, num_cpus=num_cpus,
                                   imbalance_threshold=imbalance_threshold,
                                   graceful_shutdown_timeout_s=graceful_shutdown_timeout_s,
                                   router=router)
    handle = serve.run(deployment.bind(engine_args, app_name, threads), name=app_name,
                       route_prefix=None, blocking=False)

    def teardown() -> None:
        with _suppressed():
            serve.delete(app_name)
        with _suppressed():
            ray.kill(directory)
        if started_ray:
            with _suppressed():
                serve.shutdown()
            with _suppressed():
                ray.shutdown()

    try:
        client = RayEngineClient(handle, app_name, DEPLOYMENT, Pins(directory),
                                 on_shutdown=teardown)
        # serve.run returned with the replicas running; only Loom's router publishes its view.
        left_s = max(1.0, start_timeout_s - (time.monotonic() - began))
        if router == "loom" and not wait_for_running(app_name, DEPLOYMENT, replicas, left_s):
            raise ReplicaUnavailableError(
                f"{replicas} engine replicas did not all start within {start_timeout_s} s")
    except BaseException:
        teardown()
        raise
    logger.info("%d engine replicas ready in %.1f s (%d threads each)", replicas,
                time.monotonic() - began, threads)
    return client


class _suppressed:
    """Teardown steps: a failure is logged, the next step still runs."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, tb: Any) -> bool:
        if error is not None:
            logger.warning("teardown: %s", error)
        return True
