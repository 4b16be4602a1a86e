"""Conversations the harmony tests render, each with the text the format gives it (its
special tokens spelled out). Written for these tests from the format's rules; the o200k
test proves the openai-harmony package renders each one to the same tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loom.harmony import HarmonyMessage, HarmonyTool, SystemOptions

SYSTEM_HEAD = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by "
               "OpenAI.\nKnowledge cutoff: 2024-06\n")
CHANNELS = ("# Valid channels: analysis, commentary, final. Channel must be included for "
            "every message.")
CALLS_LINE = "\nCalls to these tools must go to the commentary channel: 'functions'."

WEATHER = HarmonyTool(
    "get_weather", "Current weather for a place.\nUse it before answering about weather.",
    {"type": "object",
     "properties": {
         "location": {"type": "string", "description": "City and country, e.g. Oslo, Norway"},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
         "days": {"type": "integer", "description": "Forecast length.", "default": 1},
         "threshold": {"type": "number", "default": 0.5},
         "hourly": {"type": "boolean"},
         "fields": {"type": "array", "items": {"type": "string"}},
         "area": {"type": "object",
                  "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                  "required": ["lat", "lon"]},
         "label": {"type": ["string", "null"], "title": "Label"},
         "source": {"description": "Where the data comes from.",
                    "oneOf": [{"type": "string", "description": "A station id"},
                              {"type": "integer"}]},
     },
     "required": ["location"]})
WEATHER_TS = (
    "// Current weather for a place.\n// Use it before answering about weather.\n"
    "type get_weather = (_: {\n"
    "// City and country, e.g. Oslo, Norway\nlocation: string,\n"
    'unit?: "celsius" | "fahrenheit", // default: celsius\n'
    "// Forecast length.\ndays?: number, // default: 1\n"
    "threshold?: number, // default: 0.5\n"
    "hourly?: boolean,\n"
    "fields?: string[],\n"
    "area?: {\n    lat: number,\n    lon: number,\n    },\n"
    "// Label\n//\nlabel?: string | null,\n"
    "// Where the data comes from.\nsource?:\n | string\n | number\n,\n"
    "}) => any;\n")
PING = HarmonyTool("ping", "Checks the service.", None)


@dataclass(frozen=True)
class Case:
    """OpenAI messages, tools and system options, and the expected rendering."""

    name: str
    messages: list[dict[str, Any]]
    expected: str
    tools: list[HarmonyTool] = field(default_factory=list)
    options: SystemOptions = field(default_factory=SystemOptions)


def _system(effort: str = "medium", date: str | None = None, tools: bool = False) -> str:
    dated = f"Current date: {date}\n" if date else ""
    return (f"{SYSTEM_HEAD}{dated}\nReasoning: {effort}\n\n{CHANNELS}"
            f"{CALLS_LINE if tools else ''}<|end|>")


def _user(text: str) -> str:
    return f"<|start|>user<|message|>{text}<|end|>"


PROMPT = "<|start|>assistant"
TOOLS_HEAD = "# Tools\n\n## functions\n\nnamespace functions {\n\n"
TOOLS_TAIL = "\n} // namespace functions"

CASES = [
    Case("system_only", [], _system() + PROMPT),
    Case("user_low_effort", [{"role": "user", "content": "What is 2 + 2?"}],
         _system("low") + _user("What is 2 + 2?") + PROMPT,
         options=SystemOptions(reasoning_effort="low")),
    Case("developer_instructions_high_effort",
         [{"role": "system", "content": "Answer in French."},
          {"role": "developer", "content": "Be brief."},
          {"role": "user", "content": "Hello"}],
         _system("high", "2025-06-28")
         + "<|start|>developer<|message|># Instructions\n\nAnswer in French.\n\nBe brief.<|end|>"
         + _user("Hello") + PROMPT,
         options=SystemOptions(reasoning_effort="high", conversation_start_date="2025-06-28")),
    Case("earlier_analysis_dropped",
         [{"role": "user", "content": "What is 2 + 2?"},
          {"role": "assistant", "content": "4.", "reasoning_content": "Simple sum."},
          {"role": "user", "content": "And 3 + 3?"}],
         _system() + _user("What is 2 + 2?")
         + "<|start|>assistant<|channel|>final<|message|>4.<|end|>"
         + _user("And 3 + 3?") + PROMPT),
    Case("literal_special_text_stays_text",
         [{"role": "user", "content": "Say <|start|>assistant<|channel|>final<|message|> 東京"}],
         _system() + _user("Say <|start|>assistant<|channel|>final<|message|> 東京") + PROMPT),
    Case("tool_call_and_result",
         [{"role": "system", "content": "Use the tools."},
          {"role": "user", "content": "Weather in Oslo?"},
          {"role": "assistant", "content": "", "reasoning_content": "Need the weather tool.",
           "tool_calls": [{"id": "call_1", "type": "function",
                           "function": {"name": "get_weather",
                                        "arguments": {"location": "Oslo, Norway"}}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": -3}'}],
         _system(tools=True)
         + "<|start|>developer<|message|># Instructions\n\nUse the tools.\n\n" + TOOLS_HEAD
         + WEATHER_TS + "\n// Checks the service.\ntype ping = () => any;\n" + TOOLS_TAIL
         + "<|end|>" + _user("Weather in Oslo?")
         + "<|start|>assistant<|channel|>analysis<|message|>Need the weather tool.<|end|>"
         + "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
         + '<|message|>{"location":"Oslo, Norway"}<|call|>'
         + "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
         + '{"temperature": -3}<|end|>' + PROMPT,
         tools=[WEATHER, PING]),
    Case("preamble_and_answered_turn",
         [{"role": "user", "content": "Ping it."},
          {"role": "assistant", "content": "Done.", "reasoning_content": "Old thought."},
          {"role": "user", "content": "Again, twice."},
          {"role": "assistant", "content": "Pinging twice.", "reasoning_content": "Two calls.",
           "tool_calls": [{"id": "a", "type": "function",
                           "function": {"name": "ping", "arguments": "{}"}},
                          {"id": "b", "type": "function",
                           "function": {"name": "ping", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "b", "content": "pong"},
          {"role": "tool", "name": "ping", "content": "pong"}],
         _system(tools=True) + "<|start|>developer<|message|>" + TOOLS_HEAD
         + "// Checks the service.\ntype ping = () => any;\n" + TOOLS_TAIL + "<|end|>"
         + _user("Ping it.") + "<|start|>assistant<|channel|>final<|message|>Done.<|end|>"
         + _user("Again, twice.")
         + "<|start|>assistant<|channel|>analysis<|message|>Two calls.<|end|>"
         + "<|start|>assistant<|channel|>commentary<|message|>Pinging twice.<|end|>"
         + ("<|start|>assistant to=functions.ping<|channel|>commentary <|constrain|>json"
            "<|message|>{}<|call|>") * 2
         + ("<|start|>functions.ping to=assistant<|channel|>commentary<|message|>pong<|end|>")
         * 2 + PROMPT,
         tools=[PING]),
]


# Schemas of many kinds, with the `# Tools` section the format gives them (after
# "namespace functions {\n\n", before "} // namespace functions").
SCHEMA_ZOO = [
    HarmonyTool("no_args", "", None),
    HarmonyTool("empty", "Takes nothing.", {"type": "object", "properties": {}}),
    HarmonyTool("either", "One of two.", {"oneOf": [
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"type": "string", "description": "Raw text", "default": "x"}]}),
    HarmonyTool("kinds", "Line one.\r\nLine two.\n", {"type": "object", "properties": {
        "n": {"type": ["integer", "null"], "nullable": True},
        "s": {"type": "string", "nullable": True, "default": 'a "q"'},
        "e": {"enum": ["a", "b"]},
        "arr": {"type": "array"},
        "objs": {"type": "array",
                 "items": {"type": "object", "properties": {"k": {"type": "integer"}}}},
        "tiny": {"type": "number", "default": 1e-05},
        "big": {"type": "number", "default": 1.5e20},
        "lst": {"type": "array", "items": {"type": "string"}, "default": ["a", "é"]},
        "flag": {"type": "boolean", "default": True},
        "nothing": {"default": None},
        "ex": {"type": "string", "examples": ["x", "y"], "description": "Two\nlines"},
        "nested": {"type": "object", "description": "A point.",
                   "properties": {"x": {"type": "number"}}},
        "pick": {"description": "Same", "default": "u", "oneOf": [
            {"type": "string", "description": "Same"},
            {"type": "string", "enum": ["u", "v"], "description": "Other", "default": "v"}]},
        "mode": {"type": "integer", "enum": [1, 2], "default": 1},
    }, "required": ["n", "pick"]}),
]
SCHEMA_ZOO_TS = """type no_args = () => any;

// Takes nothing.
type empty = (_: {
}) => any;

// One of two.
type either = (_: \n | {
   a: string,
   }
 | string // Raw text default: "x") => any;

// Line one.
// Line two.
type kinds = (_: {
n: number | null,
s?: string | null, // default: "a "q""
e?: any,
arr?: Array<any>,
objs?: {
    k?: number,
    }[],
tiny?: number, // default: 0.00001
big?: number, // default: 1.5e20
lst?: string[], // default: ["a","é"]
flag?: boolean, // default: true
nothing?: any, // default: null
// Two
lines
// Examples:
// - "x"
// - "y"
ex?: string,
// A point.
nested?:     // A point.
{
    x?: number,
    },
// default: "u"
pick:
 | string
 | "u" | "v" // Other default: v
,
mode?: number, // default: 1
}) => any;
"""

# Two user turns each answered with analysis then final: the first turn's analysis is
# stale (the package's dropping rule removes it), the second's is kept.
TWO_TURNS = [HarmonyMessage("user", "a"),
             HarmonyMessage("assistant", "t1", channel="analysis"),
             HarmonyMessage("assistant", "f1", channel="final"),
             HarmonyMessage("user", "b"),
             HarmonyMessage("assistant", "t2", channel="analysis"),
             HarmonyMessage("assistant", "f2", channel="final")]
