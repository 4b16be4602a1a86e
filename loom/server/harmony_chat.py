"""The harmony format (gpt-oss's) in the server: a conversation rendered in it in place of a
chat template, and what its outputs are held to (`harmony_grammar.py`, the format's stop
tokens). The format itself, rendering and parsing, is `loom/harmony`'s; outputs are split by
channel in `output_split.HarmonySplit`.

A server serves the harmony format when its model's vocabulary carries the format's special
tokens (gpt-oss's does; no other model's does)."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loom.errors import InvalidRequestError
from loom.harmony import HarmonyCodec, HarmonyTool, SystemOptions, from_openai
from loom.sampling_params import SamplingParams, StructuredOutputsParams
from loom.server.harmony_grammar import harmony_grammar
from loom.server.tools import ToolPlan


@dataclass(frozen=True)
class HarmonyChat:
    """The harmony codec of the served model."""

    codec: HarmonyCodec

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> HarmonyChat | None:
        """The format for a model with this tokenizer; None when its vocabulary does not
        carry the harmony tokens."""
        codec = HarmonyCodec.for_tokenizer(tokenizer)
        return None if codec is None else cls(codec)

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool,
               tools: ToolPlan | None, template_kwargs: dict[str, Any] | None,
               reasoning_effort: str | None) -> list[int]:
        """A conversation's prompt ids in the harmony format: OpenAI's messages (as
        `as_template_input` gives them), the offered tools as the `functions` namespace, the
        reasoning effort (the request's, else `chat_template_kwargs["reasoning_effort"]`,
        else medium; another value is refused by `SystemOptions`) and today's date in the
        system message. Any other template variable is refused (the format has no template
        to take it)."""
        extra = dict(template_kwargs or {})
        effort = reasoning_effort or extra.pop("reasoning_effort", None) or "medium"
        if extra:
            raise InvalidRequestError(
                f"chat_template_kwargs {', '.join(sorted(extra))} do not apply to this model's "
                "harmony format (it takes reasoning_effort only)",
                param="chat_template_kwargs", code="invalid_request")
        offered = [HarmonyTool(t.function.name, t.function.description or "",
                               t.function.parameters) for t in (tools.offered if tools else ())]
        options = SystemOptions(reasoning_effort=effort,
                                conversation_start_date=datetime.date.today().isoformat())
        return self.codec.render(from_openai(list(messages), offered, options),
                                 add_generation_prompt)

    def held_to_format(self, params: SamplingParams, tools: ToolPlan | None,
                       constraint: StructuredOutputsParams | None) -> SamplingParams:
        """`params` for a chat output: the format's grammar under the request's tools and
        constraint (none when neither constrains), and its stop tokens."""
        stops = sorted(set(params.stop_token_ids or ()) | set(self.codec.stop_token_ids))
        return params.with_updates(
            structured_outputs=harmony_grammar(self.codec.special_ids, tools, constraint),
            stop_token_ids=stops)
