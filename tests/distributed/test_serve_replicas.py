"""`loom serve` over two engine replicas on Ray Serve (one Ray instance for the module, the
tiny Gemma 3 model, a Redis store the replicas share): every call of a session and every
turn of a `previous_response_id` chain lands on one replica (its `x-loom-replica` header),
and the later turns are served from the cache; concurrent agent conversations lose nothing;
a session whose replica is killed between two segments continues on the other from Redis
with the tokens and logprobs of a run where nothing was killed; a drained replica's running
segment ends its stream with a final event; without a store, the lost session is a 404
naming the cause."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import pytest
from distributed.conftest import replica_actor
from redis_process import start_redis
from server.conftest import engine_args, run_server, run_weather_agent
from server.test_server_robustness import TEMPLATE

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from loom.distributed.launch import start_replicas  # noqa: E402

PROMPT = "Once upon a time, in a land far away, there lived"
SEGMENT = {"max_tokens": 6, "temperature": 0, "logprobs": 2}
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server not installed: apt-get install redis-server (make test "
                    "tries to)")
    server = start_redis(binary, tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(ray_instance, redis, tiny_models):
    """The OpenAI server over 2 replicas sharing the Redis store."""
    args = engine_args(tiny_models, num_kv_blocks=1024, kv_transfer_config={
        "kv_connector": "RedisConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"url": redis.url}})
    client = start_replicas(args, 2, app_name="served", threads=1, num_cpus=0.5,
                            graceful_shutdown_timeout_s=20)
    try:
        with run_server(client, chat_template=TEMPLATE) as srv:
            yield srv
    finally:
        client.shutdown()


def post(srv, path: str, body: dict, **headers: str) -> httpx.Response:
    response = httpx.post(srv.base_url + path, json=body, headers=headers, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response


def replica(response: httpx.Response) -> str:
    name = response.headers.get("x-loom-replica")
    assert name, f"no x-loom-replica header: {dict(response.headers)}"
    return name


def test_a_sessions_calls_and_a_response_chain_stay_on_their_replica(server):
    opened = post(server, "/v1/sessions", {"prompt": PROMPT})
    sid, home = opened.json()["id"], replica(opened)
    for text in (" and", " a dragon", " who said"):
        assert replica(post(server, f"/v1/sessions/{sid}/append",
                            {"text": text, **SEGMENT})) == home
    view = httpx.get(f"{server.base_url}/v1/sessions/{sid}", timeout=TIMEOUT_S)
    assert view.status_code == 200 and replica(view) == home

    previous, chain_home, seen = None, None, 0
    for turn in range(3):
        body = {"model": "test-model", "input": f"Turn {turn}: tell me more.",
                "max_output_tokens": 4, "temperature": 0}
        if previous is not None:
            body["previous_response_id"] = previous
        answer = post(server, "/v1/responses", body)
        chain_home = chain_home or replica(answer)
        assert replica(answer) == chain_home
        usage = answer.json()["usage"]
        if turn:  # the earlier turns' tokens came from the cache (the forked session), all
            # but the last, whose logits the turn needs
            assert usage["input_tokens_details"]["cached_tokens"] >= seen - 1
        seen = usage["input_tokens"]
        previous = answer.json()["id"]

    # Requests under one x-session-id go where the first went.
    first = post(server, "/v1/completions", {"model": "test-model", "prompt": "a b c",
                                             "max_tokens": 2}, **{"x-session-id": "agent-7"})
    for _ in range(3):
        again = post(server, "/v1/completions", {"model": "test-model", "prompt": "x y",
                                                 "max_tokens": 2},
                     **{"x-session-id": "agent-7"})
        assert replica(again) == replica(first)


def test_sixteen_concurrent_conversations_over_two_replicas_lose_nothing(server):
    async def conversation(client: httpx.AsyncClient, index: int) -> list[int]:
        statuses, previous = [], None
        for turn in range(3):
            body = {"model": "test-model", "max_output_tokens": 3, "temperature": 0,
                    "input": f"Agent {index}, step {turn}: what next?"}
            if previous is not None:
                body["previous_response_id"] = previous
            answer = await client.post("/v1/responses", json=body)
            statuses.append(answer.status_code)
            if answer.status_code != 200:
                break
            assert answer.json()["status"] in ("completed", "incomplete")
            previous = answer.json()["id"]
        return statuses

    async def run_all() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT_S) as client:
            return await asyncio.gather(*(conversation(client, i) for i in range(16)))

    statuses = asyncio.run(run_all())
    assert all(s == [200, 200, 200] for s in statuses), statuses

    # /metrics: one series per replica, labelled by its id and index.
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base_url}/metrics", timeout=TIMEOUT_S).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    generated = {s.labels["replica"]: s.value
                 for s in families["vllm:generation_tokens"].samples}
    assert set(generated) == server.engine.running_replicas()
    assert sum(generated.values()) >= 16 * 3 * 3
    engines = {s.labels["engine"] for s in families["vllm:num_requests_running"].samples}
    assert engines == {"0", "1"}


def segment_after(srv, sid: str, text: str) -> tuple[list[int], list, str]:
    """A greedy segment after `text`: its tokens, its logprobs and the serving replica."""
    answer = post(srv, f"/v1/sessions/{sid}/append", {"text": text, **SEGMENT})
    body = answer.json()
    return body["token_ids"], body["logprobs"], replica(answer)


def test_a_killed_replicas_session_continues_from_redis_bit_identically(server):
    def conversation(kill: bool):
        opened = post(server, "/v1/sessions", {"prompt": PROMPT})
        sid = opened.json()["id"]
        first = segment_after(server, sid, " The first")
        if kill:
            ray.kill(replica_actor("served", first[2]), no_restart=True)
        second = segment_after(server, sid, " And then the second")
        httpx.delete(f"{server.base_url}/v1/sessions/{sid}", timeout=TIMEOUT_S)
        return first, second

    reference = conversation(kill=False)
    moved = conversation(kill=True)
    assert moved[1][2] != moved[0][2]  # the second segment ran on the other replica
    assert moved[0][:2] == reference[0][:2]
    assert moved[1][0] == reference[1][0]  # tokens
    assert moved[1][1] == reference[1][1]  # logprobs, the same floats


def test_a_drained_replicas_running_segment_ends_with_a_final_event(server):
    client = server.engine
    deadline = time.monotonic() + TIMEOUT_S  # Serve replaces the replica killed above
    while len(client.running_replicas() - set(client.pins.known_gone())) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    opened = post(server, "/v1/sessions", {"prompt": "Count: one two three"})
    sid, home = opened.json()["id"], replica(opened)
    events = []
    with httpx.stream("POST", f"{server.base_url}/v1/sessions/{sid}/generate",
                      json={"max_tokens": 400, "temperature": 0, "ignore_eos": True,
                            "stream": True}, timeout=TIMEOUT_S) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 2:  # generating: drain its replica now
                stopped = asyncio.run(client.drain_replica(home))
                assert stopped == [sid]
    final = events[-1]
    assert final["object"] == "session.generation" and final["finish_reason"] is not None
    assert len(final["token_ids"]) < 400


def test_without_a_store_a_lost_session_is_a_404_naming_the_cause(ray_instance, tiny_models):
    client = start_replicas(engine_args(tiny_models), 1, app_name="unstored", threads=1,
                            num_cpus=0.5, graceful_shutdown_timeout_s=5)
    try:
        with run_server(client) as srv:
            opened = post(srv, "/v1/sessions", {"prompt": PROMPT})
            sid, home = opened.json()["id"], replica(opened)
            ray.kill(replica_actor("unstored", home), no_restart=True)
            answer = httpx.post(f"{srv.base_url}/v1/sessions/{sid}/append",
                                json={"text": " more"}, timeout=TIMEOUT_S)
            assert answer.status_code == 404, answer.text
            error = answer.json()["error"]
            assert error["code"] == "session_lost"
            assert home in error["message"] and "no shared store" in error["message"]
    finally:
        client.shutdown()


def test_the_real_model_over_two_replicas_serves_the_agent_clients(ray_instance, redis,
                                                                   gemma_path):
    """Gemma 3 270M in the default mode (w4a8 from its GGUF blocks) on 2 replicas: the
    openai client's Responses chain, openai-agents' Runner calling a function tool and
    LangChain's ChatOpenAI, unchanged; a chain whose replica is killed between two turns
    continues on the other with the same tokens and logprobs as a chain nothing disturbed."""
    pytest.importorskip("agents")
    openai = pytest.importorskip("openai")
    langchain_openai = pytest.importorskip("langchain_openai")
    from loom.engine.config import EngineArgs

    args = EngineArgs(model=str(gemma_path), num_kv_blocks=512, kv_transfer_config={
        "kv_connector": "RedisConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"url": redis.url}})
    client = start_replicas(args, 2, app_name="real", threads=1, num_cpus=0.5,
                            graceful_shutdown_timeout_s=10)
    try:
        with run_server(client, served_model_name="gemma") as srv:
            api = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused",
                                max_retries=0, timeout=120)

            def two_replicas_running() -> None:
                deadline = time.monotonic() + 120  # Serve replaces a killed replica
                while len(client.running_replicas() - set(client.pins.known_gone())) < 2:
                    assert time.monotonic() < deadline, "no second replica"
                    time.sleep(0.2)

            def chain(kill: bool) -> list[str]:
                two_replicas_running()
                texts, previous = [], None
                for turn, text in enumerate(("Name a colour.", "Name another one.")):
                    raw = api.responses.with_raw_response.create(
                        model="gemma", input=text, previous_response_id=previous,
                        max_output_tokens=8, temperature=0)
                    answer = raw.parse()
                    texts.append(answer.output_text)
                    previous = answer.id
                    if kill and turn == 0:
                        ray.kill(replica_actor("real", raw.headers["x-loom-replica"]),
                                 no_restart=True)
                return texts

            def session(kill: bool) -> list[tuple[list[int], list, str]]:
                two_replicas_running()
                sid = post(srv, "/v1/sessions", {"prompt": "The three primary colours are"}
                           ).json()["id"]
                segments = [segment_after(srv, sid, " red,")]
                if kill:
                    ray.kill(replica_actor("real", segments[0][2]), no_restart=True)
                segments.append(segment_after(srv, sid, " and the secondary ones are"))
                return segments

            reference = chain(kill=False)
            assert all(reference)
            assert chain(kill=True) == reference
            reference = session(kill=False)
            moved = session(kill=True)
            assert moved[1][2] != moved[0][2]
            # The default mode's tokens and logprobs, the same on the other replica.
            for got, want in zip(moved, reference, strict=True):
                assert got[0] == want[0], (got, want)  # tokens
                assert got[1] == want[1], (got, want)  # logprobs

            calls, final_output = run_weather_agent(srv.base_url, "gemma")
            assert calls and json.loads(final_output)["temperature_c"] == 21

            chat = langchain_openai.ChatOpenAI(
                base_url=f"{srv.base_url}/v1", api_key="unused", model="gemma",
                temperature=0, max_tokens=16, max_retries=0)
            assert chat.invoke("Say hello.").text
    finally:
        client.shutdown()
