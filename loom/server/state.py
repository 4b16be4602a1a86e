"""`ServerConfig` (the server's own flags) and `ServerState` (what every route shares)."""

from __future__ import annotations

import contextlib
import hashlib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from loom.engine.client import EngineClient
from loom.engine.outputs import RequestOutput
from loom.engine.token_budget import TokenBudget
from loom.errors import (
    AuthenticationError,
    InvalidRequestError,
    LoomError,
    ModelNotFoundError,
    RequestFailedError,
    SessionLostError,
)
from loom.sampling_params import RequestOutputKind, SamplingParams
from loom.server.harmony_chat import HarmonyChat
from loom.server.limits import check_api_key
from loom.server.output_split import HarmonySplit, OutputSplit, TextSplit
from loom.server.protocol import ToolFields
from loom.server.reasoning import ReasoningParser, ReasoningStream, prompt_thinking
from loom.server.tools import TemplateToolSupport, ToolPlan, plan_tools, template_inputs
from loom.tokenizer import ChatTemplate

# Variables Loom sets for a chat template itself: chat_template_kwargs cannot replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
})


_OWNER_RECORD = "session-owner"
# Tokens of a prompt's end read for an opened or pre-filled think block (`<think>\n\n</think>
# \n\n` is a dozen characters; a tokenizer without think tokens spells them in pieces).
_PROMPT_TAIL_TOKENS = 32


def key_digest(key: str) -> bytes:
    """What the store keeps of an API key: a digest (never the key)."""
    return hashlib.sha256(f"loom-owner:{key}".encode()).hexdigest().encode()


@dataclass(frozen=True)
class ServerConfig:
    """What `loom serve` adds to the engine's arguments."""

    served_model_name: str
    api_keys: tuple[str, ...] = ()
    chat_template: str | None = None  # a Jinja file overriding the model's template
    max_sessions_per_key: int = 64
    max_request_body_bytes: int = 4 * 2**20
    max_tokens_cap: int | None = None  # most tokens one request may generate (None: context)
    allowed_origins: tuple[str, ...] = ()
    # Responses API: a stored response's session closes after this long idle (None: never;
    # its conversation stays continuable, recomputed), and at most this many are stored.
    response_ttl_s: float | None = 3600.0
    max_stored_responses: int = 10_000
    # How a think-tag model's reasoning is split from its answer (reasoning.PARSER_CHOICES;
    # "auto": qwen3 when the chat template thinks, else none).
    reasoning_parser: str = "auto"


@dataclass
class ServerState:
    """The engine client, the model's chat template, metrics, and who owns which session."""

    engine: EngineClient
    config: ServerConfig
    metrics: Any = None  # loom.server.metrics.MetricsExporter
    reasoning: ReasoningParser | None = None  # None: outputs are all content
    # A harmony model's (gpt-oss) format: it renders conversations and splits outputs in
    # place of the chat template and the reasoning parser. None: the template's format.
    harmony: HarmonyChat | None = None
    session_owners: dict[str, str] = field(default_factory=dict)
    # Sessions whose creation is under way: they count against their key's quota already,
    # so concurrent creations cannot pass the check together.
    opening_sessions: set[str] = field(default_factory=set)
    # The chat template and what it does with tools (TemplateToolSupport), once probed.
    _tool_support: tuple[ChatTemplate, TemplateToolSupport] | None = field(
        default=None, init=False, repr=False)

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer."""
        return self.engine.tokenizer

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The model's chat template, or None: the engine's input processor holds it."""
        return self.engine.inputs.chat_template

    @property
    def max_model_len(self) -> int:
        """The context limit in tokens."""
        return self.engine.max_model_len

    def decode_token(self, token_id: int) -> str:
        """The text of one token (logprobs entries name tokens by it)."""
        return self.tokenizer.decode([token_id])

    def authenticate(self, authorization: str | None) -> str:
        """The API key an `Authorization` header carries ("" when the server has none); an
        `AuthenticationError` when it is missing or wrong."""
        key = check_api_key(authorization, self.config.api_keys)
        if key is None:
            raise AuthenticationError(
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key")
        return key

    # ---- who owns which session (kept in the KV store, where one is configured) ---------

    def own_session(self, session_id: str, key: str) -> None:
        """`key` owns the session; with a KV store the owner (a digest of the key) is kept
        beside the session, so that it is the owner again after a restart."""
        self.session_owners[session_id] = key
        store = self.engine.session_store
        if store is not None:
            store.put_record(_OWNER_RECORD, session_id, key_digest(key))

    def disown_session(self, session_id: str) -> None:
        """The session ended: forget its owner (here and in the store)."""
        if self.session_owners.pop(session_id, None) is not None:
            store = self.engine.session_store
            if store is not None:
                store.delete_record(_OWNER_RECORD, session_id)

    async def owns_live_session(self, session_id: str, key: str) -> bool:
        """Whether `key` owns a live session by this id. One of `key`'s that no engine holds
        is restored from the session store: kept there across a restart (its owner is the
        stored digest), or moved (its replica is gone: another continues it from its
        snapshot). A `SessionLostError` (its replica is gone and nothing keeps it) is
        raised as it is, so the caller learns why."""
        known = self.session_owners.get(session_id)
        if known is not None and known != key:
            return False
        if known == key and await self.engine.holds(session_id):
            return True
        store = self.engine.session_store
        if known is None and (store is None or store.get_record(_OWNER_RECORD, session_id)
                              != key_digest(key)):
            return False
        try:
            await self.engine.restore_session(session_id)
        except SessionLostError:
            raise
        except LoomError:
            return False
        self.session_owners[session_id] = key
        return True

    def check_model(self, model: str | None) -> None:
        """`ModelNotFoundError` for a name this server does not serve (None: the served
        one)."""
        if model is not None and model != self.config.served_model_name:
            raise ModelNotFoundError(f"model {model!r} does not exist; this server serves "
                                     f"{self.config.served_model_name!r}", param="model",
                                     code="model_not_found")

    def budget(self, requested: int | None) -> TokenBudget:
        """A request's max_tokens as asked, under this server's cap (the engine resolves it
        for a session's length: `EngineClient.start_segment`)."""
        return TokenBudget(requested, self.config.max_tokens_cap)

    def max_tokens(self, requested: int | None, prompt_len: int) -> int:
        """The request's max_tokens: the cap and the context left after the prompt bound it
        (`TokenBudget.resolve`); asking for more than either is refused naming the field
        (a `ContextLengthError`, or an `InvalidRequestError` past the cap)."""
        return self.budget(requested).resolve(prompt_len, self.max_model_len)

    def prompt_or_messages(
        self, prompt: str | list[int] | None, messages: Sequence[Any] | None,
        add_generation_prompt: bool = True, tools: Sequence[Any] | None = None,
    ) -> str | list[int]:
        """The body's prompt as given, or its messages' ids through the chat template (with
        `tools` offered); refused unless exactly one of the two is present."""
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt",
                                      code="invalid_request")
        if tools and messages is None:
            raise InvalidRequestError("tools are rendered with messages: give messages, not a "
                                      "prompt", param="tools", code="invalid_request")
        if messages is not None:
            plan = plan_tools(ToolFields(tools=list(tools))) if tools else None
            return self.chat_ids(messages, add_generation_prompt, plan)
        assert prompt is not None
        return prompt

    def chat_ids(self, messages: Sequence[Any], add_generation_prompt: bool = True,
                 tools: ToolPlan | None = None,
                 template_kwargs: dict[str, Any] | None = None,
                 reasoning_effort: str | None = None) -> list[int]:
        """A conversation's prompt ids through the chat template (refused without one),
        with the tools `tools` offers and any tool calls and results in the messages as the
        template can take them (`tools.template_inputs`); `template_kwargs` (vLLM's
        `chat_template_kwargs`, e.g. `enable_thinking`) are the template's extra variables.
        A harmony model's conversation is rendered in its format instead (`harmony_chat.py`;
        `reasoning_effort` goes to its system message)."""
        if self.harmony is not None:
            return self.harmony.render([m.as_template_input() for m in messages],
                                       add_generation_prompt, tools, template_kwargs,
                                       reasoning_effort)
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(template_kwargs or ()))
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs cannot set {', '.join(reserved)}",
                                      param="chat_template_kwargs", code="invalid_request")
        template = self.chat_template
        if template is None:
            raise InvalidRequestError(
                f"model {self.config.served_model_name!r} has no chat template; start the "
                "server with --chat-template FILE", param="messages", code="no_chat_template")
        inputs = [m.as_template_input() for m in messages]
        if tools is None and not template_kwargs and not any(
                m.get("tool_calls") or m["role"] == "tool" for m in inputs):
            # Rendered as the engine renders; the context limit is checked with max_tokens (a
            # 400 naming it, state.max_tokens), the vocabulary when the engine adds it.
            return self.engine.inputs.render_chat("messages", inputs, add_generation_prompt)
        inputs, extra = template_inputs(inputs, tools or ToolPlan((), None, True),
                                        self.tool_support(template))
        return template.render_ids(self.tokenizer, inputs, add_generation_prompt,
                                   **(template_kwargs or {}), **extra)

    def tool_support(self, template: ChatTemplate) -> TemplateToolSupport:
        """What the chat template does with tools (probed once per template)."""
        if self._tool_support is None or self._tool_support[0] is not template:
            self._tool_support = (template, TemplateToolSupport.probe(template))
        return self._tool_support[1]

    def output_split(self, prompt_ids: Sequence[int], constrained: bool,
                     names: frozenset[str] | None) -> OutputSplit:
        """A fresh split of one output of this prompt into reasoning, content and calls
        (`output_split.py`); `constrained`: the output follows a grammar; `names`: the
        offered tools' names (None: the output holds no calls)."""
        if self.harmony is not None:
            return HarmonySplit(self.harmony.codec.parser(), names)
        return TextSplit(self.reasoning_stream(prompt_ids, constrained), names)

    def reasoning_stream(self, prompt_ids: Sequence[int], constrained: bool = False
                         ) -> ReasoningStream | None:
        """A stream splitting one output of this prompt into reasoning and content (None
        without a reasoning parser); `constrained`: the output follows a grammar."""
        if self.reasoning is None:
            return None
        tail = self.tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL_TOKENS:]),
                                     skip_special_tokens=False)
        return self.reasoning.stream(prompt_thinking(tail), constrained)

    def reasoning_tokens(self, texts: Sequence[str]) -> int | None:
        """Tokens of outputs' reasoning texts, as the tokenizer spells them (usage's
        `reasoning_tokens`); None without a reasoning parser (or the harmony format)."""
        if self.reasoning is None and self.harmony is None:
            return None
        return sum(len(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts if t)

    @property
    def end_token_ids(self) -> list[int]:
        """The tokens that end a generation: the tokenizer's and the model's end tokens."""
        return sorted(set(self.tokenizer.eos_token_ids) | set(self.engine.config.eos_token_ids))

    # ---- running requests ---------------------------------------------------------------

    async def stream(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Run one request, yielding what each step added (DELTA outputs). Whatever ends the
        iteration early (a client that went away, an error) aborts it, freeing its KV, and
        its output queue is dropped either way (`AsyncLLMEngine.generate` does both)."""
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        params = params.with_updates(output_kind=RequestOutputKind.DELTA)
        outputs = self.engine.generate(prompt_ids, params, request_id)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                if out.error is not None:
                    # The engine could not serve it (KV pool held by pinned sessions, a
                    # failed KV load under "fail"): nothing wrong with the request itself.
                    raise RequestFailedError(out.error, code="request_failed")
                yield out
