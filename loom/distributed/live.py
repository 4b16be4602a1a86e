"""What the routers of one deployment share in this process: the replicas they see running,
and one routing policy (its prefix memory and recent sends).

Serve may build several routers for one deployment in a process (one per kind of handle:
plain and streaming calls), each with its own view of the replicas, updated at its own
moment. The replicas running are those every router sees (a replica one router already
dropped as dead is not running); one policy serves them all, so a prompt sent by a
streaming call is matched by a plain one. Ray Serve pickles a custom router's module by
value, so this state lives here (imported by reference), not in the router's module.
"""

from __future__ import annotations

import threading

from loom.distributed.routing import RoutingPolicy

_VIEWS: dict[tuple[str, str], dict[int, frozenset[str]]] = {}
_POLICIES: dict[tuple[str, str], RoutingPolicy] = {}
_CHANGED = threading.Condition()


def shared_policy(app_name: str, deployment: str, imbalance_threshold: int,
                  prefix_memory: int) -> RoutingPolicy:
    """The deployment's one routing policy in this process (the first router's settings)."""
    with _CHANGED:
        key = (app_name, deployment)
        if key not in _POLICIES:
            _POLICIES[key] = RoutingPolicy(imbalance_threshold, prefix_memory)
        return _POLICIES[key]


def publish_running(app_name: str, deployment: str, router: int,
                    replicas: frozenset[str]) -> None:
    """Router `router`'s view of the running replicas changed."""
    with _CHANGED:
        _VIEWS.setdefault((app_name, deployment), {})[router] = replicas
        _CHANGED.notify_all()


def running_replicas(app_name: str, deployment: str) -> frozenset[str]:
    """The replica ids every router of the deployment in this process sees running (empty
    before any call)."""
    views = list(_VIEWS.get((app_name, deployment), {}).values())
    return frozenset.intersection(*views) if views else frozenset()


def wait_for_running(app_name: str, deployment: str, count: int, timeout_s: float) -> bool:
    """Wait until the router sees at least `count` running replicas; False on timeout."""
    with _CHANGED:
        return _CHANGED.wait_for(
            lambda: len(running_replicas(app_name, deployment)) >= count, timeout_s)
