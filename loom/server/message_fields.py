"""Chat messages and tools in request bodies: the functions a model may call, which one
`tool_choice` forces, and the messages of a conversation (with the calls an assistant made)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from loom.server.request_base import StrictModel

# A function's name (a named tool_choice that matches none is refused as naming no tool).
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"


class FunctionDefinition(StrictModel):
    """A function the model may call: its name, what it does, its arguments' JSON schema."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    """One entry of `tools` (only functions exist)."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    """The function a named `tool_choice` forces."""

    name: str = Field(json_schema_extra={"pattern": FUNCTION_NAME_PATTERN})


class NamedToolChoice(StrictModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(StrictModel):
    """OpenAI's tool calling (`loom/server/tools.py` reads them)."""

    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True


class TextPart(StrictModel):
    """One part of a message's content (only text is supported)."""

    type: Literal["text"]
    text: str


class CalledFunction(StrictModel):
    """The function of a call an assistant made: its name and its arguments' JSON text."""

    name: str
    arguments: str


class ToolCall(StrictModel):
    """One call in an assistant message's `tool_calls`."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(StrictModel):
    """One message of a conversation: an assistant's may carry `tool_calls` (content null)
    and `reasoning_content` (as a response gave it; a thinking model's template renders or
    drops it), a `tool` message answers the call named by its `tool_call_id`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The dict a chat template sees; calls' arguments as objects when they are JSON
        objects (as transformers' templates expect), else as the text given."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [{
                "id": call.id, "type": "function",
                "function": {"name": call.function.name,
                             "arguments": _json_object_or_text(call.function.arguments)},
            } for call in self.tool_calls]
        return message


def _json_object_or_text(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text
