"""Agent frameworks on the Responses API of `loom serve`, unchanged: the openai-agents SDK
with its default (Responses) model running an agent that calls a function tool, and
LangChain's `ChatOpenAI(use_responses_api=True)`, on the real Gemma 3 270M."""

from __future__ import annotations

import json

import pytest
from server.conftest import run_weather_agent, served_clients

pytest.importorskip("agents")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m"


@pytest.fixture(scope="module")
def server(gemma_engine):
    with served_clients(gemma_engine, MODEL) as (running, _, _):
        yield running


def test_an_agent_calls_a_function_tool(server) -> None:
    calls, final_output = run_weather_agent(server.base_url, MODEL)
    assert calls and isinstance(calls[0], str)
    assert json.loads(final_output)["temperature_c"] == 21


def test_langchain_on_the_responses_api(server) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return json.dumps({"city": city, "temperature_c": 21})

    model = langchain_openai.ChatOpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", model=MODEL, temperature=0,
        max_tokens=24, max_retries=0, use_responses_api=True)
    reply = model.invoke("Say hello.")
    assert reply.text
    with_tools = model.bind_tools([get_weather], tool_choice="get_weather")
    messages = [HumanMessage("What is the weather in Paris?")]
    first = with_tools.invoke(messages)
    assert first.tool_calls and first.tool_calls[0]["name"] == "get_weather"
    call = first.tool_calls[0]
    messages += [first, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = model.bind_tools([get_weather]).invoke(messages)
    assert answer.text or answer.tool_calls
