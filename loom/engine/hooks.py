"""Sequence hooks: code that runs on every sampled token, before detokenisation and stops.

A hook sees the token a sequence just sampled and may act on the sequence through a
`HookContext`: spawn a child that shares its KV, block it (it keeps its KV and is not
scheduled), append tokens and unblock it, finish it, or run an async function whose result
is appended before it continues. `<promise>`/`<sync>` (`loom.engine.promise_sync`) is the
built-in hook; users register their own with `EngineArgs(hooks=[...])`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loom.engine.sequence_table import SequenceTable
    from loom.tokenizer import Tokenizer

# What an async hook function returns: text or token ids to append before continuing.
AsyncResult = str | Sequence[int]


class SequenceHook:
    """Base class of hooks; override what you need (both do nothing by default)."""

    def on_token(self, ctx: HookContext, seq_id: str, token_id: int) -> None:
        """Called after `token_id` was sampled and appended, before detokenisation."""

    def on_finished(self, ctx: HookContext, seq_id: str) -> None:
        """Called when a sequence finished (stopped, or finished by a hook)."""


@dataclass
class PendingCall:
    """An async function a hook asked to run for a blocked sequence."""

    seq_id: str
    fn: Callable[[], Awaitable[AsyncResult]]


class HookContext:
    """What a hook may do to the engine's sequences (ids are the scheduler's sequence ids).

    It acts only through the sequence table's lifecycle API; the async calls it collects
    are run by whoever drives the engine (`LLMEngine` inline, `AsyncLLMEngine` on its loop).
    """

    def __init__(self, table: SequenceTable) -> None:
        self._table = table
        self.warnings: dict[str, int] = {}
        self.pending_calls: list[PendingCall] = []

    @property
    def tokenizer(self) -> Tokenizer:
        """The engine's tokenizer."""
        return self._table.tokenizer

    def warn(self, what: str) -> None:
        """Count a condition a hook ignored (for example a limit that was reached)."""
        self.warnings[what] = self.warnings.get(what, 0) + 1

    def depth(self, seq_id: str) -> int:
        """0 for a request's own sequence, 1 for its children, and so on."""
        return self._table[seq_id].depth

    def parent(self, seq_id: str) -> str | None:
        """The parent's sequence id, or None."""
        return self._table[seq_id].parent_id

    def children(self, seq_id: str) -> list[str]:
        """Children spawned by the sequence and not joined yet, in spawn order."""
        return list(self._table[seq_id].children)

    def mark_joined(self, seq_id: str) -> None:
        """Forget the sequence's current children for later joins (they stay in its outputs)."""
        self._table[seq_id].children.clear()

    def is_finished(self, seq_id: str) -> bool:
        """True when the sequence finished (or no longer exists)."""
        seq = self._table.get(seq_id)
        return seq is None or seq.request.is_finished

    def has_unfinished_children(self, seq_id: str) -> bool:
        """True while any child of the sequence still runs."""
        return any(not self.is_finished(c) for c in self.children(seq_id))

    def is_blocked(self, seq_id: str) -> bool:
        """True while the sequence waits for its children or an async call."""
        return self._table[seq_id].blocked

    def generated_token_ids(self, seq_id: str) -> list[int]:
        """Tokens after the sequence's own prompt (a child: after the shared context)."""
        return list(self._table[seq_id].output_token_ids)

    def spawn_child(self, seq_id: str, max_tokens: int | None = None) -> str | None:
        """Fork a child that shares the sequence's KV; None if the KV pool cannot take it."""
        return self._table.fork(seq_id, max_tokens)

    def block(self, seq_id: str) -> None:
        """Stop scheduling the sequence; it keeps its KV until `unblock`."""
        self._table[seq_id].blocked = True

    def unblock(self, seq_id: str, append: AsyncResult | None = None) -> None:
        """Append tokens (text or ids; only they are prefilled) and let the sequence go on."""
        ids = None
        if append:
            ids = (
                self.tokenizer.encode(append, add_special_tokens=False)
                if isinstance(append, str)
                else [int(t) for t in append]
            )
        self._table.unblock(seq_id, ids)

    def finish(self, seq_id: str) -> None:
        """End the sequence now with finish_reason "stop"."""
        self._table[seq_id].finish_requested = True

    def run_async(self, seq_id: str, fn: Callable[[], Awaitable[AsyncResult]]) -> None:
        """Block the sequence, run `fn()`, append what it returns, and unblock it."""
        self.block(seq_id)
        self.pending_calls.append(PendingCall(seq_id, fn))

    def take_pending_calls(self) -> list[PendingCall]:
        """Async calls hooks asked for since the last take."""
        calls, self.pending_calls = self.pending_calls, []
        return calls
