"""Tool calling without a model: validating `tools` / `tool_choice`, rendering tools and
calls for templates with and without tool support, and parsing the call format, whole and
streamed in any chunking."""

from __future__ import annotations

import json
import random

import pytest

from loom.errors import InvalidRequestError
from loom.server.protocol import ChatCompletionRequest, ChatMessage
from loom.server.tool_calls import ToolCallParser, parse_whole, stream_deltas
from loom.server.tools import TemplateToolSupport, plan_tools, template_inputs
from loom.tokenizer import ChatTemplate

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMES = frozenset({"get_weather", "get_time"})

# A template without tools (Gemma's turn format, simplified) and one that knows them.
PLAIN = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
         "{% if add_generation_prompt %}<assistant>{% endif %}")
TOOLED = ("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
          "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
          "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} "
          "{{ c.function.arguments | tojson }}]{% endfor %}</{{ m.role }}>{% endfor %}")


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 **fields)


def test_tool_choice_is_validated():
    assert plan_tools(_request()).offered == ()
    auto = plan_tools(_request(tools=[WEATHER, TIME]))
    assert auto.forced is None and auto.names == NAMES and auto.parses
    assert plan_tools(_request(tools=[WEATHER], tool_choice="none")).offered == ()
    named = plan_tools(_request(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_time"}}))
    assert named.forced == "get_time"
    assert "get_time" in named.constraint([1]).grammar
    assert "get_weather" not in named.constraint([1]).grammar
    bad = [
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
         "tool_choice"),
        (dict(tools=[WEATHER, WEATHER]), "tools"),
    ]
    for fields, param in bad:  # refusals of the request (the HTTP adapter's 400s)
        with pytest.raises(InvalidRequestError) as error:
            plan_tools(_request(**fields))
        assert error.value.param == param
    with pytest.raises(InvalidRequestError, match="cannot be combined"):
        plan_tools(_request(tools=[WEATHER], tool_choice="required"), constrained=True)


def test_forced_grammar_shape():
    single = plan_tools(_request(tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False)).constraint([1, 106])
    assert single.grammar.startswith("start: call end\n") and "<[106]>" in single.grammar
    many = plan_tools(_request(tools=[WEATHER, TIME], tool_choice="required")).constraint(())
    assert many.grammar.startswith("start: call+\n")
    # A function without parameters takes an empty object.
    assert '"additionalProperties": false' in many.grammar.split("f1: ")[1]
    # Definitions move to the root of the call's schema, where `#/$defs/...` points.
    day = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "$defs": {"Day": {"enum": ["mon", "tue"]}},
        "properties": {"day": {"$ref": "#/$defs/Day"}}}}}
    grammar = plan_tools(_request(tools=[day], tool_choice="required")).constraint(()).grammar
    schema = json.loads(grammar.split("f0: %json ")[1])
    assert schema["$defs"] == {"Day": {"enum": ["mon", "tue"]}}
    assert "$defs" not in schema["properties"]["arguments"]


def _conversation() -> list[dict]:
    messages = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Weather in Paris and the time?"),
        ChatMessage(role="assistant", content=None, tool_calls=[
            {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "function": {"name": "get_time", "arguments": "{}"}}]),
        ChatMessage(role="tool", tool_call_id="c1", content="sunny"),
        ChatMessage(role="tool", tool_call_id="c2", content="noon"),
    ]
    return [m.as_template_input() for m in messages]


def test_a_template_without_tools_gets_them_as_text():
    template = ChatTemplate(PLAIN)
    support = TemplateToolSupport.probe(template)
    assert support == TemplateToolSupport(reads_tools=False, renders_calls=False)
    plan = plan_tools(_request(tools=[WEATHER, TIME]))
    messages, extra = template_inputs(_conversation(), plan, support)
    assert extra == {}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call functions.")
    assert '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert messages[3]["content"] == ("Tool result (get_weather): sunny\n\n"
                                      "Tool result (get_time): noon")
    assert "tool_calls" not in messages[2]
    template.render(messages)  # renders


def test_a_template_with_tools_gets_them_as_they_are():
    template = ChatTemplate(TOOLED)
    support = TemplateToolSupport.probe(template)
    assert support == TemplateToolSupport(reads_tools=True, renders_calls=True)
    plan = plan_tools(_request(tools=[WEATHER]))
    conversation = _conversation()
    messages, extra = template_inputs(conversation, plan, support)
    assert messages == conversation
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    text = template.render(messages, **extra)
    assert '[call get_weather {"city": "Paris"}]' in text and "<tool>sunny</tool>" in text


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
OUTPUTS = [
    "Just text, no calls.",
    CALL,
    f"{CALL}\n{CALL.replace('Paris', 'Rome')}\n",
    f"Let me check. {CALL} Done.",
    '<tool_call>{"name": "unknown", "arguments": {}}</tool_call> and text',
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>',
    f'{CALL}<tool_call>{{"name": "get_weather", "argu',  # cut by max_tokens
    "ends with a partial <tool_",
    "   ",
]


@pytest.mark.parametrize("text", OUTPUTS)
def test_streamed_parsing_equals_the_whole(text):
    content, calls = parse_whole(text, NAMES)
    rng = random.Random(text)
    for _ in range(5):
        parser, pieces, i = ToolCallParser(NAMES), [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            pieces += parser.feed(text[i:i + n])
            i += n
        pieces += parser.finish()
        deltas = stream_deltas(pieces, 0)
        streamed = "".join(d.get("content", "") for d in deltas)
        assert (streamed or None) == content
        got = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        assert [g["index"] for g in got] == list(range(len(calls)))
        assert [(g["function"]["name"], g["function"]["arguments"]) for g in got] == [
            (c.name, c.arguments) for c in calls]


def test_parsed_calls():
    content, calls = parse_whole(OUTPUTS[2], NAMES)
    assert content is None
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert len({c.id for c in calls}) == 2 and calls[0].id.startswith("call_")
    assert parse_whole(OUTPUTS[3], NAMES)[0] == "Let me check.  Done."
    assert parse_whole(OUTPUTS[4], NAMES) == (OUTPUTS[4], [])
    assert json.loads(parse_whole(OUTPUTS[6], NAMES)[1][0].arguments) == {"zone": "UTC"}
    cut_content, cut_calls = parse_whole(OUTPUTS[7], NAMES)
    assert len(cut_calls) == 1 and cut_content == '<tool_call>{"name": "get_weather", "argu'
    assert parse_whole("   ", NAMES) == (None, [])
