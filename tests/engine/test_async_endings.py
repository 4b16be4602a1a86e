"""Every way a request ends reaches the caller waiting on its outputs within a second: a
session closed, a request aborted, the engine shut down, a failed step; a wait on an id with
no outputs is an error at once; after a shutdown every call is refused. Through HTTP a
stream that ends so still sends its error event and `data: [DONE]`."""

from __future__ import annotations

import asyncio

import pytest
from engine.helpers import make_engine, prompt_ids

from loom import SamplingParams
from loom.engine.async_engine import AsyncLLMEngine
from loom.errors import EngineShutDownError, SessionClosedError, UnknownRequestError

LONG = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)


async def first_then_rest(engine: AsyncLLMEngine, rid: str) -> asyncio.Task:
    """A waiter on `rid`'s outputs that has seen its first output: (outputs, error)."""
    seen = asyncio.Event()

    async def consume() -> tuple[list, BaseException | None]:
        outs = []
        try:
            async for out in engine.outputs(rid):
                outs.append(out)
                seen.set()
        except Exception as error:
            return outs, error
        return outs, None

    task = asyncio.ensure_future(consume())
    await asyncio.wait_for(seen.wait(), 60)
    return task


@pytest.mark.parametrize("way", ["close", "abort", "shutdown", "failed step"])
def test_each_ending_reaches_the_waiter(tiny_models, way, monkeypatch):
    folder, _ = tiny_models["llama"]

    async def scenario() -> None:
        engine = AsyncLLMEngine(make_engine(folder, max_model_len=8192))
        rid = "r"
        await engine.add_request(rid, prompt_ids(9), LONG, session=way == "close")
        waiter = await first_then_rest(engine, rid)
        if way == "close":
            await engine.close(rid)
        elif way == "abort":
            await engine.abort(rid)
        elif way == "shutdown":
            engine.shutdown()
        else:
            def broken() -> None:
                raise RuntimeError("the device fell off")
            monkeypatch.setattr(engine.engine, "step", broken)
        outs, error = await asyncio.wait_for(waiter, 1.0)
        assert outs
        expected = {"close": SessionClosedError, "abort": UnknownRequestError,
                    "shutdown": EngineShutDownError, "failed step": RuntimeError}[way]
        assert isinstance(error, expected), error
        if way == "shutdown":
            with pytest.raises(EngineShutDownError):
                await engine.add_request("later", prompt_ids(3), LONG)
            with pytest.raises(EngineShutDownError):
                async for _ in engine.outputs("later"):
                    pass
        else:
            monkeypatch.undo()
            if engine.is_live(rid):
                await engine.abort(rid)
            with pytest.raises(UnknownRequestError, match="no outputs to wait for"):
                async for _ in engine.outputs(rid):
                    pass
            assert engine.engine.kv_pool_all_free
            engine.shutdown()

    asyncio.run(scenario())


def test_a_stream_ended_by_a_shutdown_says_so(tiny_models):
    httpx = pytest.importorskip("httpx")
    import time

    from server.conftest import run_server

    folder, _ = tiny_models["gemma3"]
    engine = make_engine(folder)
    step = engine.step

    def slow_step():  # a stream that outlasts the test's reads
        time.sleep(0.01)
        return step()

    engine.step = slow_step
    body = {"model": "test-model", "prompt": "Once upon a time", "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with run_server(engine) as server, httpx.Client(base_url=server.base_url,
                                                    timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        server.engine.shutdown()
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert any("engine_shut_down" in line for line in rest), rest[-3:]
    assert all('"finish_reason": "length"' not in line for line in rest)
