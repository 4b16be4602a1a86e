"""`InputProcessor`: prompts, conversations and fragments to token ids, validated once for
engine and server.

Every input the engine accepts passes here first: a prompt (text gets BOS, ids are checked),
a conversation (messages through the model's chat template, BOS once), a session fragment
(text without BOS), the limits that bound them (vocabulary range, context length), and a
structured-output constraint (it must compile).
`LLMEngine` and `loom serve` call the same checks, so a request is refused with the same
message whichever door it came through.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loom.engine.structured_output import StructuredOutputs
from loom.errors import InvalidRequestError, PromptTooLongError
from loom.sampling_params import SamplingParams
from loom.tokenizer import ChatTemplate, Tokenizer
from loom.tokenizer.text_checks import NOT_TEXT, has_unpaired_surrogate


def _check_text(owner: str, what: str, text: str) -> None:
    """InvalidRequestError when `text` is not Unicode text a tokenizer can take."""
    if has_unpaired_surrogate(text):
        raise InvalidRequestError(f"request {owner!r}: the {what} {NOT_TEXT}")


class InputProcessor:
    """Tokenises and validates what callers give the engine."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        chat_template: ChatTemplate | None = None,
        structured: StructuredOutputs | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.structured = structured
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # The model's chat template; None: conversations are refused. Settable after
        # construction (`loom serve` finds it, with its --chat-template override, and sets it).
        self.chat_template = chat_template

    def encode_prompt(
        self, owner: str, prompt: str | Sequence[int]
    ) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids): text is tokenised with BOS; ids are checked.
        `owner` names the request in errors."""
        if isinstance(prompt, str):
            _check_text(owner, "prompt", prompt)
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            text: str | None = prompt
        else:
            ids, text = [int(t) for t in prompt], None
        self._check_prompt(owner, ids)
        return text, ids

    def encode_chat(
        self, owner: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """A conversation's prompt ids through the chat template, checked as a prompt is.
        InvalidRequestError without a template; ChatTemplateError for messages it refuses."""
        ids = self.render_chat(owner, messages, add_generation_prompt)
        self._check_prompt(owner, ids)
        return ids

    def render_chat(
        self, owner: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """`encode_chat` without the checks (a caller that bounds the length itself, as the
        server does with max_tokens, checks the rest later): BOS once, never EOS."""
        template = self.chat_template
        if template is None:
            raise InvalidRequestError(f"request {owner!r}: the model has no chat template")
        return template.render_ids(self.tokenizer, messages, add_generation_prompt)

    def encode_fragment(self, owner: str, fragment: str | Sequence[int]) -> list[int]:
        """A session fragment's token ids: text tokenised on its own (no BOS), ids checked;
        never empty."""
        if isinstance(fragment, str):
            if not fragment:
                raise InvalidRequestError(f"session {owner!r}: the fragment is empty")
            _check_text(owner, "fragment", fragment)
            ids = self.tokenizer.encode(fragment, add_special_tokens=False)
        else:
            ids = [int(t) for t in fragment]
        if not ids:
            raise InvalidRequestError(f"session {owner!r}: the fragment has no tokens")
        self.check_token_ids(owner, ids)
        return ids

    def _check_prompt(self, owner: str, ids: Sequence[int]) -> None:
        """A prompt's ids: not empty, within the context limit, in the vocabulary."""
        if not ids:
            raise InvalidRequestError(f"request {owner!r}: the prompt is empty")
        self.check_length(owner, len(ids))
        self.check_token_ids(owner, ids)

    def check_params(self, owner: str, params: SamplingParams) -> None:
        """What `SamplingParams` cannot check alone: logit_bias ids must be in the
        vocabulary, and a structured-output constraint must compile (an invalid schema,
        regex or grammar is refused before anything is queued)."""
        if params.logit_bias:
            self.check_token_ids(owner, list(params.logit_bias))
        if params.structured_outputs is not None:
            if self.structured is None:
                raise InvalidRequestError(f"request {owner!r}: structured output is off")
            self.structured.compile(owner, params.structured_outputs)

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
