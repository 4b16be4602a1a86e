"""Structured output and tool calls under the harmony format: the grammar (llguidance's Lark
dialect, special tokens as `<[id]>`) of a whole harmony output that constrains only what the
request constrains.

The output follows the generation prompt `<|start|>assistant`. It is any number of free
messages (`analysis`, or `commentary` without a recipient: a preamble), each ended by
`<|end|><|start|>assistant`, then the last message:

- a `final` message, ended by `<|return|>`: free text, or, under `response_format` /
  `structured_outputs`, text of that constraint (JSON of the schema, a regex, a choice);
- with tools offered, a call `<|channel|>commentary to=functions.NAME <|constrain|>json
  <|message|>ARGUMENTS<|call|>`, its arguments JSON valid for NAME's parameters (compact).

A forced call (`tool_choice` "required" or a name) is the last message with nothing before
it: the grammar starts at the call's header. The format has one call a turn (`<|call|>` ends
the generation), so `parallel_tool_calls` changes nothing here.
"""

from __future__ import annotations

import json
from typing import Any

from loom.errors import InvalidRequestError
from loom.sampling_params import StructuredOutputsParams
from loom.server.protocol import Tool
from loom.server.tools import ToolPlan, call_arguments_schema


def _final_body(constraint: StructuredOutputsParams | None) -> str:
    """The grammar of a final message's text under `constraint` (None: any text)."""
    if constraint is None:
        return "TEXT"
    if constraint.json is not None or constraint.json_object:
        schema: Any = constraint.json if constraint.json is not None else {"type": "object"}
        if isinstance(schema, str):
            schema = json.loads(schema)
        flexible = constraint.whitespace_flexible
        return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_flexible": flexible}})
    if constraint.regex is not None:
        return "/" + constraint.regex.replace("/", "\\/") + "/"
    if constraint.choice is not None:
        return "(" + " | ".join(json.dumps(c) for c in constraint.choice) + ")"
    raise InvalidRequestError(
        "a grammar constrains the whole output; under the harmony format give a JSON "
        "schema, a regex or a choice (they constrain the final message)",
        param="structured_outputs", code="invalid_request")


def _call_rule(index: int, tool: Tool, tok: dict[str, str]) -> str:
    """The rest of a call to `tool` after `to=functions.`: its name, the JSON content type,
    its arguments, `<|call|>`."""
    schema = {**call_arguments_schema(tool), "x-guidance": {"whitespace_flexible": False}}
    head = json.dumps(f"{tool.function.name} ")
    return (f"call{index}: {head} {tok['constrain']} \"json\" {tok['message']} "
            f"%json {json.dumps(schema)} {tok['call']}")


def harmony_grammar(special_ids: dict[str, int], tools: ToolPlan | None,
                    constraint: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
    """The grammar of a harmony output under the request's tools and constraint (module
    docstring); None when nothing is constrained (no tools offered, no constraint).
    `special_ids`: each harmony special token's id (`HarmonyCodec.special_ids`)."""
    offered = list(tools.offered) if tools is not None else []
    forced = tools.forced if tools is not None else None
    if not offered and constraint is None:
        return None
    called = [t for t in offered if forced in (None, "required", t.function.name)]
    tok = {name.strip("<|>"): f"<[{token_id}]>" for name, token_id in special_ids.items()}
    rules: list[str] = []
    calls = ""
    if called:
        rules.append(f"call: {tok['channel']} \"commentary to=functions.\" ("
                     + " | ".join(f"call{i}" for i in range(len(called))) + ")")
        rules += [_call_rule(i, tool, tok) for i, tool in enumerate(called)]
        calls = "call"
    if forced is not None:
        rules.insert(0, "start: call")
    else:
        rules.insert(0, "start: free* last")
        rules += [f"free: {tok['channel']} (\"analysis\" | \"commentary\") {tok['message']} "
                  f"TEXT {tok['end']} {tok['start']} \"assistant\"",
                  f"final: {tok['channel']} \"final\" {tok['message']} "
                  f"{_final_body(constraint)} {tok['return']}",
                  "last: final" + (f" | {calls}" if calls else ""),
                  "TEXT: /(.|\\n)*/"]
    return StructuredOutputsParams(grammar="%llguidance {}\n" + "\n".join(rules) + "\n")
