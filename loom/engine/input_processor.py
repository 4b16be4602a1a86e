"""`InputProcessor`: prompts and fragments to token ids, validated once for engine and server.

Every input the engine accepts passes here first: a prompt (text gets BOS, ids are checked),
a session fragment (text without BOS), and the limits that bound them (vocabulary range,
context length). `LLMEngine` and `loom serve` call the same checks, so a request is refused
with the same message whichever door it came through.
"""

from __future__ import annotations

from collections.abc import Sequence

from loom.errors import InvalidRequestError, PromptTooLongError
from loom.tokenizer import Tokenizer


class InputProcessor:
    """Tokenises and validates what callers give the engine."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def encode_prompt(
        self, owner: str, prompt: str | Sequence[int]
    ) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids): text is tokenised with BOS; ids are checked.
        `owner` names the request in errors."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            text: str | None = prompt
        else:
            ids, text = [int(t) for t in prompt], None
        if not ids:
            raise InvalidRequestError(f"request {owner!r}: the prompt is empty")
        self.check_length(owner, len(ids))
        self.check_token_ids(owner, ids)
        return text, ids

    def encode_fragment(self, owner: str, fragment: str | Sequence[int]) -> list[int]:
        """A session fragment's token ids: text tokenised on its own (no BOS), ids checked;
        never empty."""
        if isinstance(fragment, str):
            if not fragment:
                raise InvalidRequestError(f"session {owner!r}: the fragment is empty")
            ids = self.tokenizer.encode(fragment, add_special_tokens=False)
        else:
            ids = [int(t) for t in fragment]
        if not ids:
            raise InvalidRequestError(f"session {owner!r}: the fragment has no tokens")
        self.check_token_ids(owner, ids)
        return ids

    def check_token_ids(self, owner: str, ids: Sequence[int]) -> None:
        """Every id must be in the vocabulary."""
        vocab = self.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise InvalidRequestError(f"request {owner!r}: token ids must be in [0, {vocab})")

    def check_length(self, owner: str, num_tokens: int) -> None:
        """`num_tokens` must fit the context limit."""
        limit = self.max_model_len
        if num_tokens > limit:
            raise PromptTooLongError(
                f"request {owner!r}: {num_tokens} tokens exceed the context limit "
                f"max_model_len={limit}"
            )
