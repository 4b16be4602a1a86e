"""Reasoning parsers (`loom/server/reasoning.py`): a think-tag model's output split into
`reasoning_content` and content, whole and streamed in any chunking; the parser `loom
serve` selects; and over HTTP on the tiny model, whose chat templates here think as Qwen3's
do (the output opens `<think>` itself, or the prompt opens it; `enable_thinking: false`
pre-fills an empty block). The tiny random model writes no tags by itself: a regex
constraint makes it, and an opened block makes any free text reasoning. The Responses
turn's events are also checked on a crafted generation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
from types import SimpleNamespace

import httpx
import pytest
from server.conftest import engine_args, run_server, wait_until
from server.test_default_models import _serve_namespace

from loom.engine.sessions import common_prefix
from loom.errors import InvalidRequestError
from loom.server.cli import server_config_from
from loom.server.output_split import TextSplit
from loom.server.reasoning import (
    PromptThinking,
    ReasoningStream,
    prompt_thinking,
    select_parser,
    thinks,
)
from loom.server.response_input import input_messages
from loom.server.response_turn import ResponseTurn
from loom.server.responses import sse
from loom.server.tools import plan_tools

openai = pytest.importorskip("openai")

MODEL = "test-model"
QWEN3 = select_parser("qwen3", None)
R1 = select_parser("deepseek_r1", None)
OPEN, CLOSED, NONE = PromptThinking.OPEN, PromptThinking.CLOSED, PromptThinking.NONE

# Qwen3's first templates: the model writes <think> itself; enable_thinking false pre-fills
# an empty block. Previous turns' reasoning_content is rendered, as Qwen3's does after the
# last user message.
WRITES_THINK = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")
# Later ones (Qwen3-2507 Thinking, Qwen3.5): the generation prompt opens the block.
OPENS_THINK = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|><think>\n"
    "{% if enable_thinking is defined and not enable_thinking %}\n</think>\n\n{% endif %}"
    "{% endif %}")
HI = [{"role": "user", "content": "Hi."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}
CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}"\}\}</tool_call>'


def split(stream: ReasoningStream, text: str) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content) through a fresh `stream` (None for either
    when it is empty): what its deltas add up to."""
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return (reasoning + more_reasoning) or None, (content + more_content) or None


# ---------------------------------------------------------------- the parser, whole


@pytest.mark.parametrize(("parser", "thinking", "text", "expected"), [
    # the output opens the block (Qwen3's first templates)
    (QWEN3, NONE, "<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "\n\nanswer")),
    (QWEN3, NONE, "  <think>plan</think>answer", ("plan", "answer")),
    (QWEN3, NONE, "plain answer", (None, "plain answer")),
    (QWEN3, NONE, "answer with a stray </think> tag", (None, "answer with a stray </think> tag")),
    # the prompt opened it: no start tag in the output, everything before </think> reasons
    (QWEN3, OPEN, "plan</think>answer", ("plan", "answer")),
    (QWEN3, OPEN, "<think>plan</think>answer", ("plan", "answer")),
    # no end tag: all reasoning where a block is open (max_tokens cut it), else all content
    (QWEN3, OPEN, "still thinking", ("still thinking", None)),
    (QWEN3, NONE, "<think>still thinking", ("still thinking", None)),
    (QWEN3, NONE, "<thi", (None, "<thi")),
    (QWEN3, OPEN, "", (None, None)),
    # an empty think block: no reasoning
    (QWEN3, NONE, "<think></think>answer", (None, "answer")),
    (QWEN3, OPEN, "</think>answer", (None, "answer")),
    # enable_thinking false pre-filled an empty block: all content, tags and all
    (QWEN3, CLOSED, "answer</think>more", (None, "answer</think>more")),
    (R1, CLOSED, "answer", (None, "answer")),
    # deepseek_r1: an output starts inside a block even when its prompt opened none
    (R1, NONE, "plan</think>answer", ("plan", "answer")),
    (R1, NONE, "<think>plan</think>answer", ("plan", "answer")),
    (R1, NONE, "plan, cut", ("plan, cut", None)),
    # what follows the end tag is content, verbatim, a second block included
    (QWEN3, OPEN, "a</think>b<think>c</think>d", ("a", "b<think>c</think>d")),
])
def test_whole_split(parser, thinking, text, expected) -> None:
    stream = parser.stream(thinking)
    assert split(stream, text) == expected
    # The text before the content, as generated, then the content: the whole output.
    assert stream.head + (expected[1] or "") == text


def _streamed(parser, thinking, pieces: list[str], constrained=False) -> tuple[str, str]:
    stream = parser.stream(thinking, constrained)
    reasoning = content = ""
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


def _chunkings(text: str, rng: random.Random) -> list[list[str]]:
    """`text` one character at a time, whole, and in random cuts."""
    out = [list(text), [text]]
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) - 1)))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


@pytest.mark.parametrize(("parser", "thinking", "text"), [
    (QWEN3, NONE, "\n<think>\nstep one </thin k\n</think>\n\nThe answer"),
    (QWEN3, NONE, "No thinking at all, just </think> text"),
    (QWEN3, OPEN, "plan <think> </ </think>answer"),
    (QWEN3, OPEN, "cut inside the block </thi"),
    (QWEN3, CLOSED, "<think>x</think>y"),
    (R1, NONE, "plan</think></think>"),
])
def test_streamed_equals_whole_in_any_chunking(parser, thinking, text) -> None:
    whole = split(parser.stream(thinking), text)
    expected = (whole[0] or "", whole[1] or "")
    for pieces in _chunkings(text, random.Random(text)):
        assert _streamed(parser, thinking, pieces) == expected, pieces


def test_streaming_holds_back_only_what_may_become_a_tag() -> None:
    stream = QWEN3.stream(NONE)
    assert stream.feed("\n") == ("", "")  # whitespace: the output may still open a block
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>pla") == ("pla", "")
    assert stream.feed("n</th") == ("n", "")  # "</th" may be the end tag
    assert stream.feed("e") == ("</the", "")  # it was not
    assert stream.feed("</think>ans") == ("", "ans")
    assert stream.feed("wer") == ("", "wer")
    assert stream.finish() == ("", "")
    plain = QWEN3.stream(NONE)
    assert plain.feed(" <") == ("", "")
    assert plain.feed("b>") == ("", " <b>")  # not <think>: content from here on, held included


def test_a_constrained_output_starts_outside_the_block() -> None:
    """A grammar picks the text from its first token: the prompt's open block does not make
    it reasoning; a block the output opens itself still is."""
    assert _streamed(QWEN3, OPEN, ['{"a": 1}'], constrained=True) == ("", '{"a": 1}')
    assert _streamed(R1, NONE, ["plain"], constrained=True) == ("", "plain")
    assert _streamed(QWEN3, OPEN, ["<think>x</think>y"], constrained=True) == ("x", "y")
    assert _streamed(QWEN3, CLOSED, ["<think>x</think>y"], constrained=True) == (
        "", "<think>x</think>y")


def test_prompt_thinking_reads_the_prompt_end() -> None:
    assert prompt_thinking("<|assistant|>\n<think>\n") is OPEN
    assert prompt_thinking("<|assistant|>\n<think>\n\n</think>\n\n") is CLOSED
    assert prompt_thinking("<think>a</think>b<|end|>\n<|assistant|>\n") is NONE
    assert prompt_thinking("") is NONE


# ---------------------------------------------------------------- selection


def test_parser_selection() -> None:
    assert select_parser("qwen3", None) is QWEN3 and select_parser("none", WRITES_THINK) is None
    assert select_parser("deepseek_r1", "x") is R1
    assert select_parser("auto", WRITES_THINK) is QWEN3
    assert select_parser("auto", "{% if enable_thinking %}{% endif %}") is QWEN3
    assert select_parser("auto", "{{ messages }}") is None and select_parser("auto", None) is None
    assert thinks(OPENS_THINK) and not thinks(None)
    with pytest.raises(InvalidRequestError, match=r"'bogus'.*auto, qwen3, deepseek_r1, none"):
        select_parser("bogus", None)


def test_the_serve_flag(capsys) -> None:
    assert server_config_from(_serve_namespace([])).reasoning_parser == "auto"
    flagged = server_config_from(_serve_namespace(["--reasoning-parser", "deepseek_r1"]))
    assert flagged.reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit):
        _serve_namespace(["--reasoning-parser", "bogus"])
    error = capsys.readouterr().err
    assert "--reasoning-parser: invalid choice: 'bogus'" in error and "qwen3" in error


# ---------------------------------------------------------------- input items


def test_a_reasoning_input_item_becomes_the_next_assistant_message_reasoning() -> None:
    messages, stored = input_messages([
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "plan"}],
         "encrypted_content": None},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "more"}]},
        {"type": "message", "role": "assistant", "content": "done"},
    ])
    assert [(m.role, m.reasoning_content) for m in messages] == [
        ("user", None), ("assistant", "plan"), ("tool", None), ("assistant", "more")]
    assert messages[1].as_template_input()["reasoning_content"] == "plan"
    assert [s["type"] for s in stored] == ["message", "reasoning", "function_call",
                                           "function_call_output", "reasoning", "message"]
    assert stored[1] == {"id": "rs_1", "type": "reasoning", "summary": [],
                         "content": [{"type": "reasoning_text", "text": "plan"}],
                         "status": "completed"}
    with pytest.raises(InvalidRequestError) as error:
        input_messages([{"type": "reasoning", "summary": [{"type": "input_text", "text": ""}]}])
    assert error.value.param == "input[0].summary"


# ---------------------------------------------------------------- a Responses turn


class _Engine:
    """An engine client that generates the given deltas (the last one finishing)."""

    def __init__(self, deltas: list[str]) -> None:
        self.deltas = deltas

    async def outputs(self, request_id):
        for i, text in enumerate(self.deltas):
            last = i == len(self.deltas) - 1
            yield SimpleNamespace(error=None, outputs=[SimpleNamespace(
                text=text, token_ids=[7], finish_reason="stop" if last else None)])

    async def get_session(self, request_id):
        return SimpleNamespace(num_cached_tokens=0)


class _Host:
    """A response service that keeps the final response (a word is a reasoning token)."""

    def __init__(self, deltas: list[str]) -> None:
        self.state = SimpleNamespace(
            engine=_Engine(deltas), config=SimpleNamespace(served_model_name=MODEL),
            reasoning_tokens=lambda texts: sum(len(t.split()) for t in texts))
        self.final = None

    async def finish(self, turn, final) -> None:
        self.final = final

    async def abandon(self, turn) -> None:
        raise AssertionError("the turn was abandoned")


def _turn(deltas: list[str]) -> tuple[ResponseTurn, _Host]:
    from loom.server.protocol import ResponsesRequest

    body = ResponsesRequest(model=MODEL, input="q", stream=True, tools=[{
        "type": "function", "name": "get_weather", "parameters": {"type": "object"}}])
    host = _Host(deltas)
    tools = plan_tools(body.chat_tools())
    return ResponseTurn(host, body, "resp_1", "", [1, 2, 3], [], [], tools,
                        TextSplit(QWEN3.stream(OPEN), tools.names)), host


def _events(turn: ResponseTurn) -> list[dict]:
    async def collect() -> list[dict]:
        return [event async for event in turn.events()]

    return asyncio.run(collect())


def test_a_turn_gives_a_reasoning_item_then_the_message_and_calls() -> None:
    turn, host = _turn(["two ", "words</th", "ink>\n\nHello <tool",
                        '_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                        "</tool_call>"])
    events = _events(turn)
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert host.final == final
    reasoning, message, call = final["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "two words"}]
    assert reasoning["summary"] == [] and reasoning["status"] == "completed"
    assert events[3]["part"] == {"type": "reasoning_text", "text": ""}
    assert events[6]["text"] == "two words" and events[8]["item"] == reasoning
    assert message["content"][0]["text"] == "\n\nHello " == final["output_text"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Oslo"}
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
    # The openai client reads it (the reasoning item's shape is OpenAI's).
    parsed = openai.types.responses.ResponseReasoningItem.model_validate(reasoning)
    assert parsed.content[0].text == "two words"
    # The next turn renders the output as generated: the think block, then the answer.
    following = turn.assistant_message()
    assert following.content == "two words</think>\n\nHello "
    assert following.tool_calls[0].function.name == "get_weather"
    assert sse(final)  # strict JSON


def test_a_turn_that_only_reasons() -> None:
    turn, _ = _turn(["thinking ", "still"])
    final = _events(turn)[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning"]
    assert final["output_text"] == "" and final["output"][0]["status"] == "completed"
    assert turn.assistant_message().content == "thinking still"


# ---------------------------------------------------------------- over HTTP


@contextlib.contextmanager
def _think_server(tiny_models, folder, template_text: str, num_kv_blocks: int):
    """(server, openai client) on the tiny model with `template_text` as its chat template;
    the KV pool is checked free after it stops."""
    template = folder / "template.jinja"
    template.write_text(template_text)
    with run_server(engine_args(tiny_models, num_kv_blocks=num_kv_blocks),
                    chat_template=str(template), served_model_name=MODEL) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                               max_retries=0, timeout=120)
        yield server, client
    assert server.llm_engine.kv_pool_all_free


@pytest.fixture(scope="module")
def writes_think(tiny_models, tmp_path_factory):
    """A server whose template lets the model open the block (Qwen3's first templates)."""
    with _think_server(tiny_models, tmp_path_factory.mktemp("writes"), WRITES_THINK,
                       512) as served:
        yield served


@pytest.fixture(scope="module")
def opens_think(tiny_models, tmp_path_factory):
    """A server whose template opens the block in the generation prompt."""
    with _think_server(tiny_models, tmp_path_factory.mktemp("opens"), OPENS_THINK,
                       1024) as (server, client), \
            httpx.Client(base_url=server.base_url, timeout=120) as http:
        yield server, client, http
        for rid in server.app.state.responses.store.ids():
            http.delete(f"/v1/responses/{rid}")


def _forced(regex: str, max_tokens: int = 100, **extra) -> dict:
    return dict(model=MODEL, messages=HI, temperature=0, max_tokens=max_tokens,
                extra_body={"structured_outputs": {"regex": regex}}, **extra)


def _stream(client, **request) -> tuple[str, str, list, list]:
    """A streamed chat's joined reasoning and content deltas, tool call deltas and chunks."""
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **request))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    return reasoning, content, [t for d in deltas for t in d.tool_calls or ()], chunks


def test_chat_splits_a_think_block_the_model_writes(writes_think) -> None:
    server, client = writes_think
    assert server.app.state.loom.reasoning is QWEN3  # auto: the template thinks
    request = _forced(r"<think>[a-z]{2,10} [a-z]{2,10}</think>[a-z]{2,8}")
    message = client.chat.completions.create(**request)
    choice = message.choices[0]
    reasoning, content = choice.message.reasoning_content, choice.message.content
    assert re.fullmatch(r"[a-z]+ [a-z]+", reasoning) and re.fullmatch(r"[a-z]+", content)
    tokenizer = server.engine.tokenizer
    details = message.usage.completion_tokens_details
    assert details.reasoning_tokens == len(tokenizer.encode(reasoning, add_special_tokens=False))
    # Streamed: the tags come in pieces (the tiny tokenizer spells them in several tokens).
    streamed_reasoning, streamed_content, _, chunks = _stream(client, **request)
    assert (streamed_reasoning, streamed_content) == (reasoning, content)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens
    # Free text with no block is content, as without a parser; reasoning_content is null.
    plain = client.chat.completions.create(model=MODEL, messages=HI, temperature=0,
                                           max_tokens=6).choices[0].message
    assert plain.content and plain.reasoning_content is None


def test_tool_calls_are_read_from_the_content_only(writes_think) -> None:
    _, client = writes_think
    request = _forced(rf"<think>[a-z]{{2,8}}</think>{CALL}", 130, tools=[WEATHER])
    choice = client.chat.completions.create(**request).choices[0]
    assert re.fullmatch(r"[a-z]+", choice.message.reasoning_content)
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {
        "city"}
    reasoning, content, calls, _ = _stream(client, **request)
    assert reasoning == choice.message.reasoning_content and content == ""
    assert [c.function.arguments for c in calls] == [call.function.arguments]
    # A call written inside the think block is reasoning, not a call.
    inside = client.chat.completions.create(**_forced(
        rf"<think>{CALL}</think>[a-z]{{2,6}}", 130, tools=[WEATHER])).choices[0]
    assert inside.message.tool_calls is None and inside.finish_reason == "stop"
    assert inside.message.reasoning_content.startswith("<tool_call>")
    assert re.fullmatch(r"[a-z]+", inside.message.content)


def test_a_block_the_prompt_opens_and_enable_thinking_false(opens_think) -> None:
    _, client, _ = opens_think
    thought = client.chat.completions.create(model=MODEL, messages=HI, temperature=0,
                                             max_tokens=6).choices[0]
    # The block never closes in 6 tokens: all reasoning (max_tokens cut it).
    assert thought.message.reasoning_content and thought.message.content is None
    assert thought.finish_reason == "length"
    reasoning, content, _, _ = _stream(client, model=MODEL, messages=HI, temperature=0,
                                       max_tokens=6)
    assert (reasoning, content) == (thought.message.reasoning_content, "")
    # enable_thinking false pre-fills an empty block: the output is all content.
    off = client.chat.completions.create(
        model=MODEL, messages=HI, temperature=0, max_tokens=6,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    assert off.message.content and off.message.reasoning_content is None
    # A constrained output starts outside the block the prompt opened: content.
    constrained = client.chat.completions.create(**_forced("[a-z]{3,6}")).choices[0]
    assert re.fullmatch("[a-z]{3,6}", constrained.message.content)
    assert constrained.message.reasoning_content is None
    # A response's message sent back (reasoning_content included) is accepted.
    again = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=2, messages=[
        *HI, thought.message.model_dump(exclude_none=True), {"role": "user", "content": "Ok."}])
    assert again.choices[0].message.reasoning_content


def test_responses_reasoning_item_and_continuations(opens_think) -> None:
    server, client, http = opens_think
    params = dict(model=MODEL, temperature=0, max_output_tokens=6)
    first = client.responses.create(input="Hi.", **params)
    (item,) = first.output
    chat = client.chat.completions.create(model=MODEL, messages=HI, temperature=0, max_tokens=6)
    assert item.type == "reasoning" and item.content[0].text == (
        chat.choices[0].message.reasoning_content)
    assert first.output_text == "" and first.status == "incomplete"
    tokens = len(server.engine.tokenizer.encode(item.content[0].text, add_special_tokens=False))
    assert first.usage.output_tokens_details.reasoning_tokens == tokens
    # previous_response_id: the conversation continues on the first response's session,
    # forked where the re-rendered conversation leaves the tokens it holds (the earlier turn
    # is rendered with its text as generated, without the block its prompt opened).
    # (once its session has computed its last token and paused)
    assert wait_until(lambda: server.llm_engine.get_session(first.id).status == "PAUSED")
    held = server.llm_engine.get_session(first.id).token_ids
    second = client.responses.create(input="More.", previous_response_id=first.id, **params)
    assert second.output[0].type == "reasoning"
    conversation = [*HI, {"role": "assistant", "content": item.content[0].text},
                    {"role": "user", "content": "More."}]
    rendered = http.post("/tokenize", json={"messages": conversation}).json()["tokens"]
    assert second.usage.input_tokens == len(rendered)
    # The fork shares the common prefix's K/V but its last token's (recomputed for logits).
    shared = common_prefix(held, rendered) - 1
    assert second.usage.input_tokens_details.cached_tokens == shared > 0
    # Streamed: the reasoning item's events, then the response.
    events = list(client.responses.create(input="Hi.", stream=True, **params))
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.reasoning_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == item.content[0].text == events[-1].response.output[0].content[0].text
    # Stateless: the output items sent back as input (as agents do) are accepted.
    replay = client.responses.create(input=[
        {"role": "user", "content": "Hi."}, *[o.model_dump(exclude_none=True)
                                              for o in first.output],
        {"role": "user", "content": "More."}], **params)
    assert replay.status == "incomplete"
    kept = http.get(f"/v1/responses/{replay.id}/input_items", params={"order": "asc"}).json()
    assert [i["type"] for i in kept["data"]] == ["message", "reasoning", "message"]
