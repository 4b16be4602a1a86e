"""OpenAI's tool calling on the request side: what `tools` / `tool_choice` /
`parallel_tool_calls` mean for the prompt and for the constraint.

The call format (the model's side, one block per call, blocks written back to back):

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

- The prompt. A chat template that reads a `tools` variable gets the tools as is; any other
  gets a system message listing them and this format (merged into the first system message
  when there is one). An assistant message's `tool_calls` and `tool` messages go to a
  template that renders `tool_calls` as they are; any other sees the calls written in this
  format as the assistant's content and the results as one user turn,
  `Tool result (name): content` per result. `tool_choice: "none"` offers no tools.
- The constraint. `"required"` and a named function force the output into this format
  with a grammar whose every call is `{"name": <a tool's name>, "arguments": <JSON valid
  for that tool's parameters>}` (compact JSON), one call, or one or more with
  `parallel_tool_calls`, then the model's end token. `"auto"` constrains nothing: the text
  is parsed for calls afterwards (`tool_calls.py`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loom.errors import InvalidRequestError
from loom.sampling_params import StructuredOutputsParams
from loom.server.protocol import Tool, ToolFields
from loom.server.tool_calls import CALL_CLOSE, CALL_OPEN, format_call
from loom.tokenizer import ChatTemplate

# Arguments of a function declared without `parameters`: none (OpenAI's meaning).
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                  "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools after validation. `offered` is empty when no tools reach the
    model; `forced` is None (the model chooses: parse afterwards), "required" or a name."""

    offered: tuple[Tool, ...]
    forced: str | None
    parallel: bool

    @property
    def names(self) -> frozenset[str]:
        """The names a call may carry (parsing ignores blocks naming others)."""
        return frozenset(t.function.name for t in self.offered)

    @property
    def parses(self) -> bool:
        """Whether the output is parsed for calls."""
        return bool(self.offered)

    def definitions(self) -> list[dict[str, Any]]:
        """The tools as OpenAI's dicts (a template's `tools` variable)."""
        return [t.model_dump(exclude_none=True) for t in self.offered]

    def constraint(self, end_token_ids: Sequence[int]) -> StructuredOutputsParams | None:
        """The grammar that forces calls (None unless forced). `end_token_ids`: the tokens
        that may end the output after the last call (empty: the grammar ends it itself)."""
        if self.forced is None:
            return None
        return StructuredOutputsParams(grammar=_calls_grammar(
            [t for t in self.offered if self.forced in ("required", t.function.name)],
            self.parallel, end_token_ids))


def plan_tools(body: ToolFields, constrained: bool = False) -> ToolPlan:
    """Validate `tools`, `tool_choice`, `parallel_tool_calls` (an InvalidRequestError naming
    the field); `constrained`: the request has a response_format or structured_outputs
    already, which a forced call cannot combine with."""
    tools = tuple(body.tools or ())
    names = [t.function.name for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise InvalidRequestError(f"tools name the function {duplicate!r} twice",
                                  param="tools", code="invalid_request")
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise InvalidRequestError(f"tool_choice {_shown(choice)} needs tools",
                                  param="tool_choice", code="invalid_request")
    if choice == "none":
        return ToolPlan((), None, body.parallel_tool_calls)
    if choice == "auto":
        return ToolPlan(tools, None, body.parallel_tool_calls)
    forced = choice if isinstance(choice, str) else choice.function.name
    if forced != "required" and forced not in names:
        raise InvalidRequestError(f"tool_choice names the function {forced!r}, which is not "
                                  f"in tools ({', '.join(names)})", param="tool_choice",
                                  code="invalid_request")
    if constrained:
        raise InvalidRequestError(f"tool_choice {_shown(choice)} cannot be combined with "
                                  "response_format or structured_outputs",
                                  param="tool_choice", code="invalid_request")
    return ToolPlan(tools, forced, body.parallel_tool_calls)


def _shown(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice.function.name)


def call_arguments_schema(tool: Tool) -> dict[str, Any]:
    """The JSON schema a constrained call's arguments follow: the function's parameters (no
    arguments when it declares none). They name only the declared arguments unless the
    schema says otherwise: a function's signature has no extra parameters (agent frameworks
    omit the key), and a small model given the freedom keeps inventing keys until
    max_tokens."""
    arguments = dict(tool.function.parameters or _NO_PARAMETERS)
    if "properties" in arguments:
        arguments.setdefault("additionalProperties", False)
    return arguments


def _calls_grammar(tools: list[Tool], parallel: bool, end_token_ids: Sequence[int]) -> str:
    """A Lark grammar (llguidance's dialect) of one call, or one or more back to back, each a
    compact JSON object `{"name": const, "arguments": <parameters>}`, then an end token.
    Calls follow each other without a separator: small models given a separator after a
    call tend to write another call rather than end."""
    rules = [f"start: call{'+' if parallel else ''}{' end' if end_token_ids else ''}",
             f"call: {json.dumps(CALL_OPEN)} body {json.dumps(CALL_CLOSE)}",
             "body: " + " | ".join(f"f{i}" for i in range(len(tools)))]
    if end_token_ids:
        rules.append("end: " + " | ".join(f"<[{int(t)}]>" for t in sorted(end_token_ids)))
    for i, tool in enumerate(tools):
        arguments = call_arguments_schema(tool)
        # Definitions move to the root, where the parameters' `#/$defs/...` refs now point.
        defs = {k: arguments.pop(k) for k in ("$defs", "definitions") if k in arguments}
        schema = {"type": "object",
                  "properties": {"name": {"const": tool.function.name},
                                 "arguments": arguments},
                  "required": ["name", "arguments"], "additionalProperties": False,
                  "x-guidance": {"whitespace_flexible": False}, **defs}
        rules.append(f"f{i}: %json {json.dumps(schema)}")
    return "\n".join(rules) + "\n"


# ---------------------------------------------------------------- the prompt


@dataclass(frozen=True)
class TemplateToolSupport:
    """What a chat template does with tools, found by rendering probes once: whether it
    reads `tools`, and whether it renders an assistant's `tool_calls` (a template that does
    is trusted with `tool` messages too)."""

    reads_tools: bool
    renders_calls: bool

    @classmethod
    def probe(cls, template: ChatTemplate) -> TemplateToolSupport:
        """Render a probe tool and a probe call; see whether their names come out."""
        name = "loom_probe_function_3f9c"
        tool = {"type": "function", "function": {
            "name": name, "description": "probe",
            "parameters": {"type": "object", "properties": {}}}}
        user = {"role": "user", "content": "hello"}
        call = {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_probe", "type": "function",
            "function": {"name": name, "arguments": {}}}]}

        def shows(messages: list[dict[str, Any]], **extra: Any) -> bool:
            try:
                return name in template.render(messages, False, **extra)
            except Exception:  # a template that cannot take the probe does not support it
                return False

        return cls(reads_tools=shows([user], tools=[tool]),
                   renders_calls=shows([user, call], tools=[tool]))


def tools_system_text(plan: ToolPlan) -> str:
    """The system message that offers the tools to a template without a `tools` variable."""
    lines = ["You can call functions. Each is listed as a JSON object: its name, what it "
             "does, and the JSON schema of its arguments."]
    for tool in plan.offered:
        fn = tool.function
        lines.append(json.dumps({"name": fn.name, "description": fn.description or "",
                                 "parameters": fn.parameters or _NO_PARAMETERS},
                                ensure_ascii=False))
    lines.append(f"To call a function, write {CALL_OPEN}{{\"name\": <function name>, "
                 f"\"arguments\": <arguments object>}}{CALL_CLOSE}, one block per call; "
                 "the results come back in the next message.")
    return "\n".join(lines)


def template_inputs(messages: list[dict[str, Any]], plan: ToolPlan,
                    support: TemplateToolSupport) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra variables to render a conversation with `plan`'s tools through
    a template with `support` (see the module's docstring)."""
    extra: dict[str, Any] = {}
    if not support.renders_calls:
        messages = _calls_as_text(messages)
    if plan.offered and support.reads_tools:
        extra["tools"] = plan.definitions()
    elif plan.offered:
        text = tools_system_text(plan)
        if messages and messages[0]["role"] in ("system", "developer"):
            first = messages[0]
            messages = [{**first, "content": f"{first['content']}\n\n{text}"}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": text}, *messages]
    return messages, extra


def _calls_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls written in the call format as the assistant's content; each run of `tool`
    messages as one user turn naming the functions (by the calls' ids, else `name`)."""
    out: list[dict[str, Any]] = []
    called: dict[str, str] = {}  # call id -> function name
    results: list[str] = []
    for message in [*messages, None]:
        if results and (message is None or message["role"] != "tool"):
            out.append({"role": "user", "content": "\n\n".join(results)})
            results = []
        if message is None:
            break
        if message["role"] == "tool":
            name = called.get(message.get("tool_call_id") or "", message.get("name") or "tool")
            results.append(f"Tool result ({name}): {message['content']}")
            continue
        calls = message.get("tool_calls")
        if message["role"] == "assistant" and calls:
            written = []
            for call in calls:
                fn = call["function"]
                called[call["id"]] = fn["name"]
                written.append(format_call(fn["name"], fn["arguments"]))
            text = "".join(written)
            content = message["content"]
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = f"{content}\n{text}" if content else text
        out.append(message)
    return out
