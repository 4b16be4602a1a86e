"""The replica ids each deployment's router last saw running, shared in this process.

Ray Serve pickles a custom router's module by value, so a router keeps no state a client
could read in its own module; it publishes here (imported by reference) and clients read.
Each entry is replaced whole, so readers need no lock.
"""

from __future__ import annotations

import threading

_RUNNING: dict[tuple[str, str], frozenset[str]] = {}
_CHANGED = threading.Condition()


def publish_running(app_name: str, deployment: str, replicas: frozenset[str]) -> None:
    """A router's view of the running replicas changed."""
    with _CHANGED:
        _RUNNING[(app_name, deployment)] = replicas
        _CHANGED.notify_all()


def running_replicas(app_name: str, deployment: str) -> frozenset[str]:
    """The replica ids this process's router last saw running (empty before any call)."""
    return _RUNNING.get((app_name, deployment), frozenset())


def wait_for_running(app_name: str, deployment: str, count: int, timeout_s: float) -> bool:
    """Wait until the router sees at least `count` running replicas; False on timeout."""
    with _CHANGED:
        return _CHANGED.wait_for(
            lambda: len(running_replicas(app_name, deployment)) >= count, timeout_s)
