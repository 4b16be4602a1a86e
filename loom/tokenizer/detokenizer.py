"""`IncrementalDetokenizer`: stream text token by token, O(1) amortised work per token.

Decoding a token alone is wrong in two ways: a byte-fallback token may be half of a UTF-8
character, and SentencePiece decoders may strip or add a space depending on what precedes.
So each step decodes a short window that starts a little before the new tokens and keeps
only the text past the part already emitted (vLLM's prefix/read offsets):

    ids:   ... | prefix_offset ........ read_offset ........ len(ids)
                 [ already emitted      )[ new, not yet emitted  )
    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]

If `new_text` ends in U+FFFD (an incomplete character), nothing is emitted and the offsets
stay put until later tokens complete it (bounded by `_MAX_HELD_TOKENS`, after which the
replacement character is emitted: the bytes were invalid, not incomplete).
"""

from __future__ import annotations

from collections.abc import Sequence

from loom.tokenizer.tokenizer import Tokenizer

# Prompt tokens kept as left context for the first window (SentencePiece spacing, see above).
_PROMPT_CONTEXT = 5
# A UTF-8 character has at most 4 bytes, so 4 held byte tokens that still end in U+FFFD
# can never become valid: emit them.
_MAX_HELD_TOKENS = 4
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text of the tokens after a prompt, emitted as deltas that never split a character.

    Feed generated tokens with `add` and caller-appended tokens (session fragments) with
    `append_prompt`; `text` is the text of all of them, in order, and equals
    `tokenizer.decode(all_fed_ids)` whenever the prompt context does not change the
    spacing (it never does for Gemma; for a SentencePiece decoder that strips the first
    space, `text` keeps the space a token has after the prompt, as vLLM does).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # Only the prompt's tail is needed: it is the left context of the first window.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._num_context = len(self._ids)
        # Emitted text in pieces, joined only when `text` is read: feeding a token costs
        # O(its text), not O(all text so far).
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (held-back incomplete characters excluded)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def num_tokens(self) -> int:
        """Number of tokens fed after the prompt (generated and appended)."""
        return len(self._ids) - self._num_context

    @property
    def token_ids(self) -> list[int]:
        """The tokens fed after the prompt, in order (a copy)."""
        return self._ids[self._num_context :]

    @property
    def has_pending(self) -> bool:
        """Whether some fed tokens' text is held back (an incomplete UTF-8 character)."""
        return self._read_offset < len(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed generated tokens; returns the text they complete (may be empty)."""
        self._ids.extend(token_ids)
        return self._emit(force=False)

    def append_prompt(self, token_ids: Sequence[int]) -> str:
        """Feed caller-appended tokens (their text is complete); returns the text they add.

        Any output text still held back is emitted with it (the fragment ends that
        character for good). The returned string is part of `text`, not a generation delta.
        """
        self._ids.extend(token_ids)
        return self._emit(force=True)

    def flush(self) -> str:
        """Emit whatever is held back (as U+FFFD if incomplete); call when generation ends."""
        return self._emit(force=True)

    def _emit(self, force: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        decode = self._tokenizer.decode
        window = self._ids[self._prefix_offset :]
        held = self._read_offset - self._prefix_offset
        prefix_text = decode(window[:held], skip_special_tokens=self._skip_special)
        new_text = decode(window, skip_special_tokens=self._skip_special)
        pending = len(self._ids) - self._read_offset
        if not force and new_text.endswith(_REPLACEMENT) and pending < _MAX_HELD_TOKENS:
            return ""
        # new_text extends prefix_text, except around invalid bytes, where a later byte can
        # turn earlier ones into U+FFFD: emitted text is never taken back, so cut by length.
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if delta:
            self._pieces.append(delta)
        return delta
