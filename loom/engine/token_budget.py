"""`TokenBudget`: how many tokens a request or segment may generate, decided by the engine.

One rule for every door: the context left after the prompt bounds `max_tokens`, and so does
a server's cap. A request that asks for more than either is refused with an error naming
`max_tokens` (or the prompt, when it leaves no room at all); one that asks for nothing gets
as many as fit. The engine applies it under its own lock (`EngineClient.start_segment`),
where a session's length is known, so no caller code runs there; a server applies the same
rule before a plain request (`ServerState.max_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.errors import ContextLengthError, InvalidRequestError


@dataclass(frozen=True)
class TokenBudget:
    """What a caller asked for (`requested`, None: as many as fit) and the most its server
    allows one request (`cap`, None: the context)."""

    requested: int | None = None
    cap: int | None = None

    def resolve(self, prompt_len: int, max_model_len: int) -> int:
        """The request's max_tokens after a prompt of `prompt_len` tokens."""
        room = max_model_len - prompt_len
        if room < 1:
            raise ContextLengthError(
                f"the prompt has {prompt_len} tokens; this model's context limit is "
                f"{max_model_len} tokens", param="prompt")
        cap, requested = self.cap, self.requested
        limit = room if cap is None else min(room, cap)
        if requested is None:
            return limit
        if cap is not None and requested > cap:
            raise InvalidRequestError(f"max_tokens={requested} exceeds this server's cap of "
                                      f"{cap}", param="max_tokens")
        if requested > room:
            raise ContextLengthError(
                f"this model's context limit is {max_model_len} tokens: {prompt_len} in the "
                f"prompt leave {room} for max_tokens, {requested} requested",
                param="max_tokens")
        return requested
