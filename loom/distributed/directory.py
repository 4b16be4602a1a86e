"""Where pins live: which replica holds each live request and session.

`SessionDirectory` is a named, detached Ray actor (one per Loom application), so every
ingress process (each `RayEngineClient`, in each server replica) reads and writes the same
pins. `Pins` is one client's view of it: a local cache in front of the actor.

Invariants:
- A pin is written to the directory before the call that created the request or session
  (open, fork, restore) returns to its caller, and it names the replica that answered that
  call. So any ingress that learns an id from a response can find its replica.
- A pin moves only when a call naming the id was served by another replica (the holder was
  gone and the session continued from the store there); it is removed on close and abort.
- A replica marked gone stays gone (ids are never reused by Ray Serve); a pin naming a
  gone replica is kept, so that a later call can say which replica the session lived on.
- The local cache is only a shortcut: a cached pin is trusted until a call through it
  fails or is answered by another replica; then the directory is asked again.
"""

from __future__ import annotations

from typing import Any

# The actor's name and namespace; the application name is appended to the name.
DIRECTORY_NAMESPACE = "loom"
DIRECTORY_PREFIX = "loom-session-directory"


class SessionDirectory:
    """Pins (request or session id -> replica id), the replicas registered, and those gone.
    Run as a Ray actor (`directory_actor`); plain methods, each atomic in the actor."""

    def __init__(self) -> None:
        self._pins: dict[str, str] = {}
        self._replicas: dict[str, None] = {}
        self._gone: dict[str, str] = {}  # replica id -> why it is gone

    def pin(self, request_id: str, replica: str) -> None:
        """Pin an id to the replica that holds it (replacing any pin)."""
        self._pins[request_id] = replica

    def unpin(self, request_id: str) -> None:
        """Forget an id (closed or aborted)."""
        self._pins.pop(request_id, None)

    def lookup(self, request_id: str) -> str | None:
        """The replica pinned to an id, or None."""
        return self._pins.get(request_id)

    def register(self, replica: str) -> None:
        """A replica started."""
        self._replicas[replica] = None
        self._gone.pop(replica, None)

    def mark_gone(self, replica: str, why: str) -> None:
        """A replica died or was drained; its pins stay (see the module docstring)."""
        self._replicas.pop(replica, None)
        self._gone.setdefault(replica, why)

    def gone(self) -> dict[str, str]:
        """Replicas gone, with why."""
        return dict(self._gone)

    def replicas(self) -> list[str]:
        """Replicas registered and not gone."""
        return list(self._replicas)

    def pinned_to(self, replica: str) -> list[str]:
        """The ids pinned to a replica."""
        return [rid for rid, r in self._pins.items() if r == replica]


def directory_name(app_name: str) -> str:
    """The directory actor's name for a Loom application."""
    return f"{DIRECTORY_PREFIX}-{app_name}"


def directory_actor(app_name: str) -> Any:
    """The application's directory actor, created (detached, named) if none runs. Needs a
    connected Ray."""
    import ray

    return ray.remote(num_cpus=0)(SessionDirectory).options(
        name=directory_name(app_name), namespace=DIRECTORY_NAMESPACE, lifetime="detached",
        get_if_exists=True).remote()


class Pins:
    """One client's view of the directory: pins cached locally, written through."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._cache: dict[str, str] = {}
        self._gone: dict[str, str] = {}

    async def lookup(self, request_id: str, *, fresh: bool = False) -> str | None:
        """The replica pinned to `request_id` (the directory is asked on a cache miss, or
        always with `fresh`)."""
        if not fresh and request_id in self._cache:
            return self._cache[request_id]
        replica = await self.actor.lookup.remote(request_id)
        if replica is None:
            self._cache.pop(request_id, None)
        else:
            self._cache[request_id] = replica
        return replica

    def cached(self, request_id: str) -> str | None:
        """The locally known pin (no round trip)."""
        return self._cache.get(request_id)

    async def pin(self, request_id: str, replica: str) -> None:
        """Pin (written to the directory before returning)."""
        if self._cache.get(request_id) == replica:
            return
        await self.actor.pin.remote(request_id, replica)
        self._cache[request_id] = replica

    async def unpin(self, request_id: str) -> None:
        """Forget a pin everywhere."""
        self._cache.pop(request_id, None)
        await self.actor.unpin.remote(request_id)

    async def mark_gone(self, replica: str, why: str) -> None:
        """Record a replica as gone (locally at once, then in the directory)."""
        self._gone.setdefault(replica, why)
        await self.actor.mark_gone.remote(replica, why)

    async def gone(self) -> dict[str, str]:
        """Replicas gone (refreshed from the directory)."""
        self._gone.update(await self.actor.gone.remote())
        return dict(self._gone)

    def known_gone(self) -> dict[str, str]:
        """Replicas this client knows are gone (no round trip)."""
        return dict(self._gone)
