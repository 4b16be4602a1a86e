"""A conversation in the harmony format's terms: its messages and tools, the system and
developer messages the format opens with, OpenAI's chat messages mapped onto it, and which
earlier analysis (chain-of-thought) messages a prompt leaves out.

The mapping (`from_openai`), after vLLM's and gpt-oss's chat template's:
- one system message: identity, knowledge cutoff, date, `Reasoning: <effort>`, the valid
  channels, and, when function tools are offered, that calls go to the commentary channel;
- one developer message, when there is something to put in it: the client's system and
  developer messages' texts (blank-line separated, in order, wherever they stand) under
  `# Instructions`, then the tools (`typescript.py`);
- a user message as is; an assistant message as its `reasoning_content` on the analysis
  channel, then either its tool calls (each a commentary message `to=functions.NAME` of
  content type `<|constrain|>json`, the format's documented one, where vLLM and the
  template write `json`; its text the arguments' JSON) after its content, if any, as a
  commentary preamble (the order the model writes them in), or its content on the final
  channel;
- a tool result as a message authored `functions.NAME` to the assistant on the commentary
  channel; NAME is that of the earlier call with its `tool_call_id`, else its `name`.

Analysis messages the model no longer needs are dropped twice over, as vLLM and the
package do: `from_openai` drops those before the conversation's last final message
(`drop_answered_analysis`); rendering drops, when the last assistant message is a final
one, those before the first final message (`drop_stale_analysis`, the package's rule).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loom.errors import InvalidRequestError
from loom.harmony.typescript import tools_section

DEFAULT_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
DEFAULT_KNOWLEDGE_CUTOFF = "2024-06"
REASONING_EFFORTS = ("low", "medium", "high")
CHANNELS = ("analysis", "commentary", "final")
CONSTRAINED_JSON = "<|constrain|>json"
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class HarmonyMessage:
    """One message: `role` one of system, developer, user, assistant, tool (whose author
    is `author_name`, e.g. "functions.get_weather"); the header's channel, recipient
    ("functions.NAME" on a call, "assistant" on a tool result) and content type."""

    role: str
    content: str
    author_name: str | None = None
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidRequestError(f"a harmony message's role is one of {', '.join(ROLES)} "
                                      f"(got {self.role!r})", param="messages",
                                      code="invalid_value")
        if self.role == "tool" and not self.author_name:
            raise InvalidRequestError("a harmony tool message needs its author's name "
                                      "(functions.NAME)", param="messages",
                                      code="invalid_value")


@dataclass(frozen=True)
class HarmonyTool:
    """A function the model may call: name, description, arguments' JSON schema."""

    name: str
    description: str
    parameters: dict[str, Any] | None = None


@dataclass(frozen=True)
class SystemOptions:
    """What the system message says (None leaves a line out); whether it mentions tools
    follows from the tools offered."""

    reasoning_effort: str = "medium"
    model_identity: str | None = DEFAULT_IDENTITY
    knowledge_cutoff: str | None = DEFAULT_KNOWLEDGE_CUTOFF
    conversation_start_date: str | None = None

    def __post_init__(self) -> None:
        if self.reasoning_effort not in REASONING_EFFORTS:
            raise InvalidRequestError(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)} (got "
                f"{self.reasoning_effort!r})", param="reasoning_effort", code="invalid_value")


def system_text(options: SystemOptions, function_tools: bool) -> str:
    """The system message's text; `function_tools`: function tools are offered."""
    top_lines = []
    if options.model_identity is not None:
        top_lines.append(options.model_identity)
    if options.knowledge_cutoff is not None:
        top_lines.append(f"Knowledge cutoff: {options.knowledge_cutoff}")
    if options.conversation_start_date is not None:
        top_lines.append(f"Current date: {options.conversation_start_date}")
    channels = (f"# Valid channels: {', '.join(CHANNELS)}. "
                "Channel must be included for every message.")
    if function_tools:
        channels += "\nCalls to these tools must go to the commentary channel: 'functions'."
    sections = ["\n".join(top_lines)] if top_lines else []
    return "\n\n".join([*sections, f"Reasoning: {options.reasoning_effort}", channels])


def developer_text(instructions: str | None, tools: Sequence[HarmonyTool]) -> str | None:
    """The developer message's text, or None when it would say nothing."""
    sections = ["# Instructions", instructions] if instructions is not None else []
    if tools:
        sections.append(tools_section(tools))
    return "\n\n".join(sections) if sections else None


def drop_stale_analysis(messages: Sequence[HarmonyMessage]) -> list[HarmonyMessage]:
    """The package's rule for a prompt: when the last assistant message is on the final
    channel, the analysis messages before the first final message are left out."""
    last_assistant = next((m for m in reversed(messages) if m.role == "assistant"), None)
    if last_assistant is None or last_assistant.channel != "final":
        return list(messages)
    first_final = next(i for i, m in enumerate(messages) if m.channel == "final")
    return [m for i, m in enumerate(messages) if not (i < first_final
                                                      and m.channel == "analysis")]


def drop_answered_analysis(messages: Sequence[HarmonyMessage]) -> list[HarmonyMessage]:
    """vLLM's rule for a conversation's history: the analysis messages before its last
    assistant message on the final channel are left out (they led to answers given)."""
    last_final = max((i for i, m in enumerate(messages)
                      if m.role == "assistant" and m.channel == "final"), default=-1)
    return [m for i, m in enumerate(messages) if not (i < last_final
                                                      and m.channel == "analysis")]


def _arguments_text(arguments: Any) -> str:
    """A call's arguments as the message text: JSON text as given, an object as compact
    JSON (as the model writes it)."""
    if arguments is None:
        return ""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


def _assistant(message: dict[str, Any], calls: dict[str, str]) -> list[HarmonyMessage]:
    """An OpenAI assistant message's harmony messages; records its calls' names by id."""
    out = []
    reasoning = message.get("reasoning_content")
    if reasoning:
        out.append(HarmonyMessage("assistant", reasoning, channel="analysis"))
    content = message.get("content") or ""
    tool_calls = message.get("tool_calls") or []
    if not tool_calls:
        if content:
            out.append(HarmonyMessage("assistant", content, channel="final"))
        return out
    if content:
        out.append(HarmonyMessage("assistant", content, channel="commentary"))
    for call in tool_calls:
        function = call.get("function") or {}
        name = function.get("name", "")
        if call.get("id") is not None:
            calls[call["id"]] = name
        out.append(HarmonyMessage("assistant", _arguments_text(function.get("arguments")),
                                  channel="commentary", recipient=f"functions.{name}",
                                  content_type=CONSTRAINED_JSON))
    return out


def _tool_result(index: int, message: dict[str, Any], calls: dict[str, str]) -> HarmonyMessage:
    call_id = message.get("tool_call_id")
    name = calls.get(call_id) if call_id is not None else None
    name = name or message.get("name")
    if not name:
        raise InvalidRequestError(
            f"messages[{index}]: a tool message answers no earlier call (tool_call_id "
            f"{call_id!r} matches no call, and it has no name)", param="messages",
            code="invalid_value")
    return HarmonyMessage("tool", message.get("content") or "", author_name=f"functions.{name}",
                          channel="commentary", recipient="assistant")


def from_openai(messages: list[dict[str, Any]], tools: list[HarmonyTool],
                options: SystemOptions) -> list[HarmonyMessage]:
    """OpenAI chat messages (as `ChatMessage.as_template_input` gives them) as a harmony
    conversation (module docstring). An unknown role, or a tool message that answers no
    call, is an InvalidRequestError."""
    instructions: list[str] = []
    body: list[HarmonyMessage] = []
    calls: dict[str, str] = {}
    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(
                f"messages[{index}]: role {role!r} has no place in the harmony format "
                f"(roles: {', '.join(ROLES)})", param="messages", code="invalid_value")
        if role in ("system", "developer"):
            if message.get("content"):
                instructions.append(message["content"])
        elif role == "user":
            body.append(HarmonyMessage("user", message.get("content") or ""))
        elif role == "assistant":
            body += _assistant(message, calls)
        else:
            body.append(_tool_result(index, message, calls))
    head = [HarmonyMessage("system", system_text(options, bool(tools)))]
    developer = developer_text("\n\n".join(instructions) if instructions else None, tools)
    if developer is not None:
        head.append(HarmonyMessage("developer", developer))
    return head + drop_answered_analysis(body)
