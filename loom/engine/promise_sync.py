"""The built-in `<promise>`/`<sync>` hook: fork children that share KV, join their text.

    parent:  ... <promise> ... <promise> ... <sync> | merged children text | ... (continues)
                    |             |              ^ blocked until both children finished
    child 1:  (parent's context up to <promise>) generated text ... EOS / <sync>
    child 2:  (parent's context up to its <promise>) generated text ...

A child's block table starts as its parent's (shared, ref-counted blocks); it computes only
its own new tokens. The join appends the merged text after `<sync>`, so the parent prefills
exactly those tokens (plus the `<sync>` token) before it samples again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from loom.engine.hooks import HookContext, SequenceHook
from loom.errors import InvalidRequestError


def join_with_newlines(texts: list[str]) -> str:
    """The default merge: children's texts in spawn order, one per line."""
    return "\n".join(t.strip("\n") for t in texts) + "\n"


@dataclass(frozen=True)
class SpecialKwargs:
    """Configuration of the promise/sync tokens (ids or token strings) and their limits."""

    promise_token_id: int | str | None = None
    sync_token_id: int | str | None = None
    child_max_tokens: int | None = None
    max_depth: int = 4
    max_children: int = 16
    merge: Callable[[list[str]], str] = join_with_newlines


class PromiseSyncHook(SequenceHook):
    """Spawns a child on `<promise>`; on `<sync>` blocks until the children finish, then joins.

    A child that samples `<sync>` while it has no unfinished children of its own ends there.
    Past `max_depth` or `max_children` the promise token is ordinary text and a warning is
    counted (`HookContext.warnings["promise_limit"]`).
    """

    def __init__(self, config: SpecialKwargs, promise_id: int, sync_id: int) -> None:
        self.config = config
        self.promise_id = promise_id
        self.sync_id = sync_id

    @classmethod
    def from_kwargs(cls, config: SpecialKwargs, token_to_id: Callable[[str], int | None]):
        """Resolve token strings to ids; both tokens must exist in the vocabulary."""

        def resolve(value: int | str | None, name: str) -> int:
            if isinstance(value, int):
                return value
            token_id = token_to_id(value) if isinstance(value, str) else None
            if token_id is None:
                raise InvalidRequestError(f"special_kwargs.{name}={value!r} is not a token")
            return token_id

        return cls(
            config,
            resolve(config.promise_token_id, "promise_token_id"),
            resolve(config.sync_token_id, "sync_token_id"),
        )

    def on_token(self, ctx: HookContext, seq_id: str, token_id: int) -> None:
        """Fork on promise; block, or end a child, on sync."""
        if token_id == self.promise_id:
            too_deep = ctx.depth(seq_id) + 1 > self.config.max_depth
            too_many = len(ctx.children(seq_id)) >= self.config.max_children
            if (
                too_deep
                or too_many
                or ctx.spawn_child(seq_id, self.config.child_max_tokens) is None
            ):
                ctx.warn("promise_limit")
        elif token_id == self.sync_id:
            if ctx.has_unfinished_children(seq_id):
                ctx.block(seq_id)
            elif ctx.parent(seq_id) is not None:
                ctx.finish(seq_id)
            elif ctx.children(seq_id):
                self._join(ctx, seq_id)

    def on_finished(self, ctx: HookContext, seq_id: str) -> None:
        """When the last child of a blocked parent finishes, join."""
        parent = ctx.parent(seq_id)
        if parent is None or ctx.is_finished(parent) or not ctx.is_blocked(parent):
            return
        if not ctx.has_unfinished_children(parent):
            self._join(ctx, parent)

    def _join(self, ctx: HookContext, seq_id: str) -> None:
        children = ctx.children(seq_id)
        texts = [self._child_text(ctx, c) for c in children]
        merged = self.config.merge(texts)
        ctx.mark_joined(seq_id)
        ctx.unblock(seq_id, merged or None)

    def _child_text(self, ctx: HookContext, child: str) -> str:
        ids = ctx.generated_token_ids(child)
        if ids and ids[-1] == self.sync_id:
            ids = ids[:-1]  # the child's closing <sync> is not part of its result
        return ctx.tokenizer.decode(ids)
