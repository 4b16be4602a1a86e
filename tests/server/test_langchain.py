"""An agent framework's standard calls against `loom serve` with no flags: LangChain's
`ChatOpenAI` with `with_structured_output` (json_schema), `response_format` json_object and
`bind_tools` (a forced call, then the tool's result and an answer)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
from server.conftest import run_server

from loom.server.cli import add_serve_parser, engine_args_from, server_config_from

langchain_openai = pytest.importorskip("langchain_openai")
pydantic = pytest.importorskip("pydantic")


class City(pydantic.BaseModel):
    """A city and its country."""

    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


@pytest.fixture(scope="module")
def chat():
    """`loom serve` as built from no flags, and a ChatOpenAI pointed at it."""
    parser = argparse.ArgumentParser(prog="loom")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    namespace = parser.parse_args(["serve"])
    config = server_config_from(namespace)
    with run_server(engine_args_from(namespace), **dataclasses.asdict(config)) as server:
        yield langchain_openai.ChatOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", model=config.served_model_name,
            temperature=0, max_tokens=48, max_retries=0), server
    assert server.llm_engine.kv_pool_all_free


@pytest.mark.slow
def test_with_structured_output_json_schema(chat):
    model, _ = chat
    structured = model.with_structured_output(City, method="json_schema")
    city = structured.invoke("Name the capital of France and its country.")
    assert isinstance(city, City) and city.name and city.country


@pytest.mark.slow
def test_response_format_json_object(chat):
    model, _ = chat
    reply = model.bind(response_format={"type": "json_object"}).invoke(
        "Give a JSON object with the keys city and country for Paris.")
    assert isinstance(json.loads(reply.content), dict)


@pytest.mark.slow
def test_bind_tools_round_trip(chat):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return json.dumps({"city": city, "temperature_c": 21})

    model, _ = chat
    with_tools = model.bind_tools([get_weather], tool_choice="get_weather")
    messages = [HumanMessage("What is the weather in Paris?")]
    first = with_tools.invoke(messages)
    assert first.tool_calls and first.tool_calls[0]["name"] == "get_weather"
    call = first.tool_calls[0]
    assert isinstance(call["args"].get("city"), str)
    messages += [first, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = model.bind_tools([get_weather]).invoke(messages)
    assert answer.content or answer.tool_calls


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


@pytest.mark.slow
def test_json_schema_on_many_prompts_with_the_instruct_model(chat):
    """The openai client's response_format on the instruct model: every reply validates."""
    import asyncio

    import jsonschema
    import openai

    _, server = chat
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    topics = ["a pirate", "a chef", "a pilot", "a child", "a queen", "a robot", "a farmer",
              "a poet"]

    async def ask(topic: str) -> str:
        reply = await client.chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=64, temperature=0.7, seed=1,
            messages=[{"role": "user", "content": f"Describe {topic} as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON}})
        return reply.choices[0].message.content

    async def main() -> list[str]:
        try:
            return await asyncio.gather(*(ask(t) for t in topics))
        finally:
            await client.close()

    for content in asyncio.run(main()):
        jsonschema.validate(json.loads(content), PERSON)
