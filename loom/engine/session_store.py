"""Session snapshots and other small records kept beside the KV blocks, in the connector's
byte store (a folder or Redis), so that sessions and stored responses outlive the process.

Keys live under the store's KV fingerprint (the weights, the mode, the KV layout), as the
blocks do: an engine reads back only what an engine computing the same bits wrote, and the
blocks a restored session needs are under the same fingerprint. Ids are hashed into keys
(any id is a valid file name); the record keeps the id itself.

    records/<fingerprint>/<kind>/<sha256(id)>     kind "session": a SessionSnapshot;
                                                  others: bytes a service keeps

A store that fails is logged and treated as not holding the key: the engine goes on (a
session that cannot be restored is unknown, as it would be without a store).
"""

from __future__ import annotations

import hashlib
import logging

from loom.engine.sequence import SequenceState
from loom.engine.session_snapshot import SessionSnapshot, SessionSnapshotError
from loom.engine.sessions import SessionManager
from loom.errors import LoomError
from loom.kv_connector.store import KVStore

logger = logging.getLogger(__name__)


# The record kind of a session's snapshot.
_SESSION = "session"


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:40]


class SessionStore:
    """Snapshots and records in `store` under `fingerprint`."""

    def __init__(self, store: KVStore, fingerprint: str, *, save: bool = True,
                 load: bool = True) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.saves = save  # the connector's role: producer (saves) and/or consumer (loads)
        self.loads = load

    def _record_key(self, kind: str, record_id: str) -> str:
        return f"records/{self.fingerprint}/{kind}/{_digest(record_id)}"

    def save(self, snapshot: SessionSnapshot) -> bool:
        """Write (or replace) the session's snapshot; False when the store failed."""
        return self.put_record(_SESSION, snapshot.session_id, snapshot.to_bytes())

    def load(self, session_id: str) -> SessionSnapshot | None:
        """The session's snapshot, or None (none kept, unreadable, or for another id)."""
        data = self.get_record(_SESSION, session_id)
        if data is None:
            return None
        try:
            snapshot = SessionSnapshot.from_bytes(data)
        except SessionSnapshotError as error:
            logger.warning("session %r: its stored snapshot cannot be used: %s", session_id,
                           error)
            return None
        return snapshot if snapshot.session_id == session_id else None

    def delete(self, session_id: str) -> None:
        """Forget the session's snapshot (it was closed or expired)."""
        self.delete_record(_SESSION, session_id)

    def put_record(self, kind: str, record_id: str, data: bytes) -> bool:
        """Keep a service's record; False when the store failed."""
        return self.saves and self._put(self._record_key(kind, record_id), data)

    def get_record(self, kind: str, record_id: str) -> bytes | None:
        """A kept record, or None."""
        return self._get(self._record_key(kind, record_id)) if self.loads else None

    def delete_record(self, kind: str, record_id: str) -> None:
        """Forget a record."""
        self._delete(self._record_key(kind, record_id))

    # ---- the store, its failures logged -------------------------------------------------

    def _put(self, key: str, data: bytes) -> bool:
        try:
            self.store.put(key, data)
        except Exception as error:  # a full disk or a lost server must not stop the engine
            logger.warning("saving %s failed: %s", key, error)
            return False
        return True

    def _get(self, key: str) -> bytes | None:
        try:
            return self.store.get(key)
        except Exception as error:
            logger.warning("reading %s failed: %s", key, error)
            return None

    def _delete(self, key: str) -> None:
        try:
            self.store.delete(key)
        except Exception as error:
            logger.warning("deleting %s failed: %s", key, error)


class PersistedSessions:
    """Keeps every session's snapshot in a `SessionStore` as the engine runs, and brings a
    session back when an id this process never saw is asked for.

    A session is saved each time it parks (its last logits stored: the end of a prompt, a
    fragment or a segment), and each time its tokens change outside a segment or a segment
    ends (a fragment appended, a rewind: then without logits, so a restore recomputes its
    last position), at the end of the step or engine call that did it: the store never
    lags what a caller was answered, so a session continued elsewhere from it is the one
    the caller knows. It is forgotten when it is closed or expires. A process that ends any
    other way (a restart, a crash) leaves the snapshots of its sessions, which the next
    engine on the same store restores on first use.
    """

    def __init__(self, store: SessionStore, sessions: SessionManager) -> None:
        self.store = store
        self.sessions = sessions
        self._parked: dict[str, None] = {}  # parked or changed since the last flush, in order
        table = sessions.table
        table.on_session_paused.append(self._on_paused)
        table.on_session_changed.append(self._on_paused)
        table.on_group_ended.append(self._on_ended)
        table.restore_missing = self.restore

    def _on_paused(self, seq: SequenceState) -> None:
        self._parked[seq.group_id] = None

    def _on_ended(self, request_id: str, reason: str, was_session: bool) -> None:
        self._parked.pop(request_id, None)
        if was_session and reason in ("closed", "expired"):
            self.store.delete(request_id)

    def flush(self) -> None:
        """Save the sessions that parked or changed since the last call (those not
        generating)."""
        parked, self._parked = self._parked, {}
        table = self.sessions.table
        for session_id in parked:
            seq = table.get(session_id)
            if seq is None or not seq.is_session or seq.generating:
                continue
            self.store.save(self.sessions.snapshot(session_id, self.store.fingerprint))

    def restore(self, session_id: str) -> bool:
        """Open the stored session `session_id`; False when the store keeps none (or it
        cannot be opened here: logged)."""
        snapshot = self.store.load(session_id)
        if snapshot is None:
            return False
        try:
            self.sessions.restore(snapshot)
        except LoomError as error:
            logger.warning("session %r: its stored snapshot cannot be restored: %s",
                           session_id, error)
            return False
        self._parked.pop(session_id, None)  # it parked as the store keeps it: no new save
        return True
