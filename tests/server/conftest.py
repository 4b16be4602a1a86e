"""A real `loom serve` app under uvicorn on a free loopback port, in a background thread."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from processes import free_port

uvicorn = pytest.importorskip("uvicorn")


@dataclass
class RunningServer:
    """A server's address and its objects (for leak checks)."""

    base_url: str
    engine: object  # AsyncLLMEngine
    app: object

    @property
    def llm_engine(self):
        """The synchronous engine inside."""
        return self.engine.engine



def engine_args(tiny_models, **overrides):
    """EngineArgs of a float32 CPU engine on the tiny Gemma 3 model (256 KV blocks of 4
    tokens unless `overrides` say otherwise)."""
    from loom.engine.config import EngineArgs

    folder, _ = tiny_models["gemma3"]
    args = dict(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=256,
                block_size=4)
    args.update(overrides)
    return EngineArgs(**args)


@contextlib.contextmanager
def run_server(engine_args, **server_config) -> Iterator[RunningServer]:
    """Build the engine (or wrap an `LLMEngine` given instead of `EngineArgs`, or take an
    engine client as it is) and the app, serve them on 127.0.0.1, stop at exit."""
    from loom.engine.async_engine import AsyncLLMEngine
    from loom.engine.config import EngineArgs
    from loom.engine.llm_engine import LLMEngine
    from loom.server.app import build_app
    from loom.server.state import ServerConfig

    inline = None
    if isinstance(engine_args, LLMEngine):
        inline = engine_args.run_async_calls_inline
        engine = AsyncLLMEngine(engine_args)
    elif isinstance(engine_args, EngineArgs):
        engine = AsyncLLMEngine.from_engine_args(engine_args)
    else:  # an engine client (replicas on Ray Serve)
        engine = engine_args
    server_config.setdefault("served_model_name", "test-model")
    app = build_app(engine, ServerConfig(**server_config))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", engine, app)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        if inline is not None:  # a shared engine goes back to synchronous use
            engine.engine.run_async_calls_inline = inline


@contextlib.contextmanager
def served_clients(engine, model: str) -> Iterator[tuple[RunningServer, object, object]]:
    """`loom serve` on a shared engine, with an `openai` client and an httpx client on it
    (long timeouts, no retries). At exit every stored response is forgotten and the engine
    must hold no KV block."""
    import httpx
    import openai

    with run_server(engine, served_model_name=model) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                               max_retries=0, timeout=300)
        with httpx.Client(base_url=server.base_url, timeout=300) as http:
            yield server, client, http
        delete_stored_responses(server)
    assert engine.kv_pool_all_free


def delete_stored_responses(server: RunningServer) -> None:
    """Forget every stored response (each keeps its session paused on purpose)."""
    import httpx

    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for rid in server.app.state.responses.store.ids():
            http.delete(f"/v1/responses/{rid}")


def wait_until(predicate, timeout: float = 10.0) -> bool:
    """Poll `predicate` until it holds (True) or the timeout passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def run_weather_agent(base_url: str, model: str) -> tuple[list[str], str]:
    """openai-agents' Runner, with its default (Responses) model on `loom serve` at
    `base_url`, running an agent that must call a weather function tool: the cities the tool
    was called with, and the run's final output (the tool's JSON, as it stops there)."""
    import json

    import agents
    import openai

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return json.dumps({"city": city, "temperature_c": 21})

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                            max_tokens=32),
        tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    return calls, result.final_output
