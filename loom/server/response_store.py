"""Stored responses: a finished (or running) response's body, its conversation after the
turn and its input items, by id, bounded by count in memory and, with a KV store, every
finished one kept there too (read back after an eviction or a restart)."""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from loom.engine.session_store import SessionStore
from loom.errors import UnknownRequestError
from loom.server.protocol import ChatMessage
from loom.server.state import key_digest

logger = logging.getLogger(__name__)

# The kind of record a finished response is kept as in a KV store.
_RESPONSE_RECORD = "response"


@dataclass
class StoredResponse:
    """A response the store keeps: its latest body, its conversation after the turn (the
    messages the next turn renders, without instructions), its input items."""

    id: str
    owner: str
    body: dict[str, Any]
    messages: list[ChatMessage]
    input_items: list[dict[str, Any]]

    @property
    def status(self) -> str:
        """in_progress, completed, incomplete."""
        return str(self.body["status"])

    @property
    def forkable(self) -> bool:
        """Whether a continuation may fork this response's session. Not when its output
        followed a grammar (a forced tool call, `text.format`): the session keeps the
        grammar's state and a fork carries it, cut back to the fork's length, so that a next
        turn under the same constraint would go on with that document instead of starting
        its own (and a cut across a finished document does not even land where it should).
        Such a continuation opens a session of its own; the prefix cache still serves the
        blocks it shares with this one."""
        body = self.body
        forced = bool(body.get("tools")) and body.get("tool_choice") not in (None, "auto",
                                                                            "none")
        fmt = (body.get("text") or {}).get("format") or {}
        return not forced and fmt.get("type", "text") == "text"

    def to_bytes(self) -> bytes:
        """The finished response as JSON for a store (its owner as a digest of the key)."""
        return json.dumps({
            "id": self.id, "owner": key_digest(self.owner).decode(), "body": self.body,
            "messages": [m.model_dump(exclude_none=True) for m in self.messages],
            "input_items": self.input_items}).encode()

    @classmethod
    def from_bytes(cls, data: bytes, owner: str) -> StoredResponse | None:
        """A stored response read back for `owner`; None when it is another key's or the
        bytes are not one (logged)."""
        try:
            record = json.loads(data)
            if record["owner"] != key_digest(owner).decode():
                return None
            return cls(str(record["id"]), owner, record["body"],
                       [ChatMessage.model_validate(m) for m in record["messages"]],
                       list(record["input_items"]))
        except (ValueError, KeyError, TypeError) as error:
            logger.warning("a stored response cannot be read: %s", error)
            return None


class ResponseStore:
    """Stored responses by id, least recently used first, at most `max_entries` in memory
    (the oldest finished one goes, and its session with it). With a KV store (`kept`), every
    finished response is also kept there: one evicted from memory, or stored before a
    restart, is read back on use and its conversation continues (its blocks loaded from the
    store)."""

    def __init__(self, max_entries: int, kept: SessionStore | None = None) -> None:
        self.max_entries = max_entries
        self.kept = kept
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str, owner: str, param: str | None = None) -> StoredResponse:
        """The response, most recently used now; a 404 naming it when it is unknown, deleted
        or another key's."""
        entry = self._entries.get(response_id)
        if entry is None and self.kept is not None:
            data = self.kept.get_record(_RESPONSE_RECORD, response_id)
            entry = None if data is None else StoredResponse.from_bytes(data, owner)
            if entry is not None and entry.id == response_id:
                self._entries[response_id] = entry
        if entry is None or entry.owner != owner:
            what = "previous response" if param == "previous_response_id" else "response"
            raise UnknownRequestError(f"{what} {response_id!r} not found", param=param,
                                      code="response_not_found")
        self._entries.move_to_end(response_id)
        return entry

    def put(self, entry: StoredResponse) -> list[str]:
        """Store (or refresh) a response; returns the ids evicted from memory to stay within
        bounds (a finished one stays in the KV store, where there is one)."""
        self._entries[entry.id] = entry
        if self.kept is not None and entry.status != "in_progress":
            self.kept.put_record(_RESPONSE_RECORD, entry.id, entry.to_bytes())
        self._entries.move_to_end(entry.id)
        evicted = []
        for rid in list(self._entries):
            if len(self._entries) <= self.max_entries:
                break
            if self._entries[rid].status != "in_progress":
                del self._entries[rid]
                evicted.append(rid)
        return evicted

    def ids(self) -> list[str]:
        """The stored responses' ids, least recently used first."""
        return list(self._entries)

    def pop(self, response_id: str) -> StoredResponse | None:
        """Forget a response (in the KV store too)."""
        if self.kept is not None:
            self.kept.delete_record(_RESPONSE_RECORD, response_id)
        return self._entries.pop(response_id, None)
