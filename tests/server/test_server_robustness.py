"""`loom serve` under stress: clients that leave mid-request, many concurrent clients,
API keys and limits, bad input, and schemathesis fuzzing of the published OpenAPI schema.

Every test runs a real uvicorn server (tests/server/conftest.py) on the tiny random-weight
Gemma 3 model, and ends with the leak check: no request or session left in the engine and
the KV pool all free.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from server.conftest import delete_stored_responses, engine_args, run_server, wait_until

from loom.tokenizer.packaged_templates import GEMMA3_TEMPLATE, packaged_template_file

TEMPLATE = str(packaged_template_file(GEMMA3_TEMPLATE))
MODEL = "test-model"
LONG = 400  # tokens: long enough that no generation of this length ends during a test's reads


@pytest.fixture(scope="module")
def server(tiny_models):
    """The default server (no keys, default limits) with a chat template; enough KV blocks
    for 32 concurrent clients without preemption."""
    with run_server(engine_args(tiny_models, num_kv_blocks=1024), chat_template=TEMPLATE) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        yield c


def leaks(srv, timeout: float = 10.0) -> str | None:
    """What the engine still holds once it should hold nothing (None: nothing): requests or
    sessions, session owners, output queues, KV blocks. Queues of ended requests are then
    dropped, so that one leak does not fail every later test on a shared server."""
    delete_stored_responses(srv)  # a stored response keeps its session on purpose
    eng, queues = srv.llm_engine, srv.engine._queues
    owners = srv.app.state.loom.session_owners
    ok = wait_until(lambda: not eng.table.group_ids() and not owners and not queues
                    and eng.kv_pool_all_free, timeout)
    leak = (f"leak: groups={eng.table.group_ids()} owners={list(owners)} queues={list(queues)} "
            f"free={eng.num_free_blocks}/{eng.stats.num_kv_blocks}")
    for rid in list(queues):
        if not eng.is_live(rid):
            queues.pop(rid, None)
    return None if ok else leak


def assert_clean(srv, timeout: float = 10.0) -> None:
    """Nothing left in the engine (see `leaks`)."""
    leak = leaks(srv, timeout)
    assert leak is None, leak


def assert_error(response: httpx.Response, status: int, code=None, param=None) -> dict:
    """An OpenAI error body with this status (and code / param when given)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:  # the field, or a part of it ("prompt.0")
        assert error["param"] == param or str(error["param"]).startswith(f"{param}."), error
    return error


def completion(c: httpx.Client, max_tokens: int = 2, **extra) -> dict:
    """A small completion that must succeed."""
    r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time",
                                        "max_tokens": max_tokens, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == max_tokens * extra.get("n", 1)
    return body


def first_events(response: httpx.Response, count: int):
    """The first `count` SSE data events of a streaming response, and the line iterator
    (keep it: dropping a half-read iterator closes the connection)."""
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = response.iter_lines()
    events = []
    for line in lines:
        if line.startswith("data: "):
            events.append(json.loads(line[len("data: "):]))
            if len(events) == count:
                return events, lines
    raise AssertionError(f"the stream ended after {len(events)} events")


# ---- 1. clients that leave ---------------------------------------------------------------


def test_disconnect_mid_stream_aborts_completion(server, client):
    eng = server.llm_engine
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": LONG,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as own, \
            own.stream("POST", "/v1/completions", json=body) as r:  # on its own connection
        events, _lines = first_events(r, 2)
        request_id = f"{events[0]['id']}-0"
        time.sleep(0.1)
        assert eng.is_live(request_id)  # still generating when the client leaves
    gone = wait_until(lambda: not eng.is_live(request_id), 10)
    reason, leak = eng.table.ended.get(request_id), leaks(server)
    assert gone and reason == "aborted", f"the request went on after its client left: {reason}"
    assert leak is None, leak
    completion(client)  # the server still serves
    assert_clean(server)


def test_deleting_a_session_ends_its_streaming_segment(server, client):
    """The segment's stream ends (an error event naming the closed session, then [DONE])
    instead of waiting for its client's timeout; the KV is freed and the server serves on."""
    r = client.post("/v1/sessions", json={"prompt": "Once upon a time"})
    sid = r.json()["id"]
    with httpx.Client(base_url=server.base_url, timeout=30) as own, \
            own.stream("POST", f"/v1/sessions/{sid}/generate",
                       json={"max_tokens": LONG, "ignore_eos": True, "stream": True}) as r:
        _events, lines = first_events(r, 2)
        assert client.delete(f"/v1/sessions/{sid}").json()["deleted"] is True
        rest = [line for line in lines if line.startswith("data: ")]  # ends, or times out
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["type"] == "not_found_error" and sid in error["message"]
    completion(client)
    assert_clean(server)


def test_disconnect_mid_session_stream_pauses_the_session(server, client):
    eng = server.llm_engine
    r = client.post("/v1/sessions", json={"prompt": "Once upon a time"})
    assert r.status_code == 200, r.text
    sid, num_prompt = r.json()["id"], r.json()["num_tokens"]
    with httpx.Client(base_url=server.base_url, timeout=30) as own, \
            own.stream("POST", f"/v1/sessions/{sid}/generate",
                       json={"max_tokens": LONG, "ignore_eos": True, "stream": True}) as r:
        events, _lines = first_events(r, 2)
        assert all(e["object"] == "session.generation.chunk" for e in events)
        time.sleep(0.1)
        view = client.get(f"/v1/sessions/{sid}").json()
        assert view["generating"], view  # still generating when the client leaves

    def paused() -> bool:
        view = client.get(f"/v1/sessions/{sid}").json()
        return view["status"] == "PAUSED" and not view["generating"]

    assert wait_until(paused, 10), client.get(f"/v1/sessions/{sid}").text
    view = client.get(f"/v1/sessions/{sid}").json()
    assert num_prompt < view["num_tokens"] < num_prompt + LONG  # stopped early, kept its tokens
    assert view["num_computed_tokens"] == view["num_tokens"]
    assert eng.is_live(sid) and not eng.kv_pool_all_free  # paused, not closed: blocks held
    # The session goes on serving its owner.
    r = client.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert len(r.json()["token_ids"]) == 2 and r.json()["finish_reason"] == "length"
    r = client.delete(f"/v1/sessions/{sid}")
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert_error(client.get(f"/v1/sessions/{sid}"), 404, code="session_not_found")
    assert_clean(server)


def _leave_once_running(server, path: str, body: dict, running) -> None:
    """POST `body` without streaming and leave (close the connection) once `running()` says
    the engine is generating it: a client timeout that cannot fire before the request ran,
    however loaded the machine is."""

    async def go() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            task = asyncio.ensure_future(c.post(path, json=body))
            deadline = time.monotonic() + 30
            while not running() and not task.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert not task.done(), "the request ended before the client could leave"
            assert running(), "the request never started"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())


def test_client_timeout_aborts_non_streaming_requests(server, client):
    eng = server.llm_engine
    before = set(eng.table.ended)

    def completion_running() -> bool:
        return any(g.startswith("cmpl-") for g in eng.table.group_ids())

    _leave_once_running(server, "/v1/completions", {
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": LONG, "n": 4,
        "ignore_eos": True}, completion_running)
    assert_clean(server)  # the watcher saw the client leave and aborted it
    aborted = [rid for rid, why in list(eng.table.ended.items())
               if rid not in before and rid.startswith("cmpl-")]
    assert aborted and all(eng.table.ended[rid] == "aborted" for rid in aborted), aborted

    _leave_once_running(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": LONG, "ignore_eos": True},
        lambda: any(g.startswith("chatcmpl-") for g in eng.table.group_ids()))
    assert_clean(server)

    # A session's non-streaming segment: stopped, the session stays (paused).
    sid = client.post("/v1/sessions", json={"prompt": "Once upon a time"}).json()["id"]
    _leave_once_running(server, f"/v1/sessions/{sid}/generate",
                        {"max_tokens": LONG, "ignore_eos": True},
                        lambda: eng.get_session(sid).generating)
    assert wait_until(lambda: not client.get(f"/v1/sessions/{sid}").json()["generating"], 10)
    assert client.get(f"/v1/sessions/{sid}").json()["status"] == "PAUSED"
    assert client.delete(f"/v1/sessions/{sid}").status_code == 200
    completion(client)
    assert_clean(server)


# ---- 2. many concurrent clients ------------------------------------------------------------

CLIENTS, REQUESTS_PER_CLIENT = 32, 10
STEP_S = 0.01  # the least time a step takes in the load test


async def _completion_op(c: httpx.AsyncClient, i: int) -> int:
    max_tokens = 4 + i % 5
    r = await c.post("/v1/completions", json={
        "model": MODEL, "prompt": f"Once upon a time {i}", "max_tokens": max_tokens,
        "ignore_eos": True, "seed": i})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and len(body["choices"]) == 1
    choice = body["choices"][0]
    assert isinstance(choice["text"], str) and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == max_tokens
    return max_tokens


async def _chat_op(c: httpx.AsyncClient, i: int) -> int:
    max_tokens = 4 + i % 3
    r = await c.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": f"Count to {i}."}],
        "max_completion_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and len(body["choices"]) == 1
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == max_tokens
    return max_tokens


async def _stream_op(c: httpx.AsyncClient, i: int) -> int:
    max_tokens = 5
    async with c.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": f"The capital {i}", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
    assert [ch["choices"][0]["finish_reason"] for ch in chunks[:-1]][-1] == "length"
    return max_tokens


async def _session_op(c: httpx.AsyncClient, i: int) -> int:
    r = await c.post("/v1/sessions", json={"prompt": f"She sells {i}"})
    assert r.status_code == 200, r.text
    sid = r.json()["id"]
    r = await c.post(f"/v1/sessions/{sid}/append", json={"text": " sea shells"})
    assert r.status_code == 200, r.text
    assert r.json()["appended_tokens"] > 0
    r = await c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert len(r.json()["token_ids"]) == 4 and r.json()["finish_reason"] == "length"
    r = await c.post(f"/v1/sessions/{sid}/append", json={"text": " by the", "max_tokens": 2,
                                                        "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert len(r.json()["token_ids"]) == 2
    r = await c.delete(f"/v1/sessions/{sid}")
    assert r.status_code == 200 and r.json()["deleted"] is True
    return 6


async def _load(base_url: str) -> int:
    ops = [_completion_op, _chat_op, _session_op, _completion_op, _stream_op]
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as c:

        async def one_client(k: int) -> int:
            total = 0
            for j in range(REQUESTS_PER_CLIENT):
                total += await ops[(k + j) % len(ops)](c, k * REQUESTS_PER_CLIENT + j)
            return total

        return sum(await asyncio.gather(*(one_client(k) for k in range(CLIENTS))))


def test_concurrent_clients_are_batched_and_leave_nothing(server):
    eng = server.llm_engine
    assert_clean(server)
    batch_sizes: list[int] = []
    step = eng.step

    def recording_step():
        # A real model's forward takes milliseconds; the tiny one's is faster than the HTTP
        # front end here, which would leave the engine little to batch.
        time.sleep(STEP_S)
        outputs = step()
        sched = eng.last_scheduler_output
        if sched is not None and not sched.is_empty:
            batch_sizes.append(len(sched.chunks))
        return outputs

    steps_before = eng.num_steps
    eng.step = recording_step  # the async engine looks `step` up on every step
    try:
        start = time.monotonic()
        generated = asyncio.run(_load(server.base_url))
        elapsed = time.monotonic() - start
    finally:
        del eng.step
    steps = eng.num_steps - steps_before
    assert_clean(server)
    assert generated >= CLIENTS * REQUESTS_PER_CLIENT * 4
    # Served one by one, every generated token would need a step of its own.
    assert steps < generated / 4, (steps, generated, elapsed, batch_sizes)
    assert max(batch_sizes) >= CLIENTS // 2, batch_sizes
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        completion(c)
    assert_clean(server)


# ---- 3. API keys, limits, CORS ---------------------------------------------------------------


@pytest.fixture(scope="module")
def secure(tiny_models):
    with run_server(engine_args(tiny_models), chat_template=TEMPLATE, api_keys=("k1", "k2"),
                    max_sessions_per_key=2, max_request_body_bytes=2000, max_tokens_cap=8,
                    allowed_origins=("http://a.example",)) as srv:
        yield srv


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_api_keys(secure):
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 2}
    with httpx.Client(base_url=secure.base_url, timeout=30) as c:
        for headers in ({}, _auth("k3"), _auth("k1k2"), {"Authorization": "k1"},
                        {"Authorization": "Basic k1"}, {"Authorization": "Bearer"}):
            r = c.post("/v1/completions", json=body, headers=headers)
            assert_error(r, 401, code="invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
        assert_error(c.get("/v1/models"), 401)
        assert_error(c.post("/v1/sessions", json={"prompt": "x"}), 401)
        for key in ("k1", "k2"):
            r = c.post("/v1/completions", json=body, headers=_auth(key))
            assert r.status_code == 200, r.text
            assert c.get("/v1/models", headers=_auth(key)).status_code == 200
        assert c.get("/health").status_code == 200  # health needs no key
    assert_clean(secure)


def test_sessions_belong_to_their_key(secure):
    with httpx.Client(base_url=secure.base_url, timeout=30) as c:
        r = c.post("/v1/sessions", json={"prompt": "Once upon a time"}, headers=_auth("k1"))
        assert r.status_code == 200, r.text
        sid = r.json()["id"]
        k2 = _auth("k2")
        for method, path, body in [
            ("GET", "", None), ("POST", "/append", {"text": " more"}),
            ("POST", "/generate", {"max_tokens": 2}), ("POST", "/resample", {}),
            ("POST", "/rewind", {"num_tokens": 1}), ("DELETE", "", None),
        ]:
            r = c.request(method, f"/v1/sessions/{sid}{path}", json=body, headers=k2)
            assert_error(r, 404, code="session_not_found")
            # ... exactly as for a session that does not exist
            r2 = c.request(method, f"/v1/sessions/sess-nope{path}", json=body, headers=k2)
            assert r2.json()["error"]["message"].replace("sess-nope", sid) == \
                r.json()["error"]["message"]
        k1 = _auth("k1")
        view = c.get(f"/v1/sessions/{sid}", headers=k1).json()
        assert view["status"] == "PAUSED" and view["text"] == "Once upon a time"
        r = c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 2, "ignore_eos": True},
                   headers=k1)
        assert r.status_code == 200 and len(r.json()["token_ids"]) == 2, r.text
        assert c.delete(f"/v1/sessions/{sid}", headers=k1).status_code == 200
    assert_clean(secure)


def test_sessions_per_key_limit(secure):
    k1, k2 = _auth("k1"), _auth("k2")
    with httpx.Client(base_url=secure.base_url, timeout=30) as c:
        opened = [c.post("/v1/sessions", json={"prompt": f"s{i}"}, headers=k1) for i in range(2)]
        assert all(r.status_code == 200 for r in opened)
        ids = [r.json()["id"] for r in opened]
        assert_error(c.post("/v1/sessions", json={"prompt": "s3"}, headers=k1), 429,
                     code="too_many_sessions")
        r = c.post("/v1/sessions", json={"prompt": "other key"}, headers=k2)  # its own quota
        assert r.status_code == 200, r.text
        other = r.json()["id"]
        assert c.delete(f"/v1/sessions/{ids[0]}", headers=k1).status_code == 200
        r = c.post("/v1/sessions", json={"prompt": "s3"}, headers=k1)
        assert r.status_code == 200, r.text
        ids[0] = r.json()["id"]
        assert_error(c.post("/v1/sessions", json={"prompt": "s4"}, headers=k1), 429)
        for sid in ids:
            assert c.delete(f"/v1/sessions/{sid}", headers=k1).status_code == 200
        assert c.delete(f"/v1/sessions/{other}", headers=k2).status_code == 200
    assert_clean(secure)


def test_concurrent_session_creations_respect_the_quota(secure, monkeypatch):
    """Six creations at once with one key (quota 2), each slow to compute its prompt (as a
    real model's is): two open, four get 429, and closing the two frees the key again."""
    add_request = secure.engine.add_request

    async def slow_add_request(*args, **kwargs):
        await asyncio.sleep(0.3)
        return await add_request(*args, **kwargs)

    monkeypatch.setattr(secure.engine, "add_request", slow_add_request)

    async def create_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=secure.base_url, timeout=60) as c:
            return await asyncio.gather(*[
                c.post("/v1/sessions", json={"prompt": f"race {i}"}, headers=_auth("k1"))
                for i in range(6)])

    responses = asyncio.run(create_all())
    opened = [r.json()["id"] for r in responses if r.status_code == 200]
    assert len(opened) == 2, [r.status_code for r in responses]
    assert all(r.status_code == 429 for r in responses if r.status_code != 200)
    with httpx.Client(base_url=secure.base_url, timeout=30) as c:
        for sid in opened:
            assert c.delete(f"/v1/sessions/{sid}", headers=_auth("k1")).status_code == 200
        r = c.post("/v1/sessions", json={"prompt": "after"}, headers=_auth("k1"))
        assert r.status_code == 200, r.text
        assert c.delete(f"/v1/sessions/{r.json()['id']}", headers=_auth("k1")).status_code == 200
    assert_clean(secure)


def test_concurrent_appends_that_generate_leave_only_the_accepted_fragment(server):
    """Two appends with sampling parameters at once on one session: one generates, the other
    is refused with 409 before its fragment is appended (it used to be appended anyway)."""
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        r = c.post("/v1/sessions", json={"prompt": "Once upon a time"})
        assert r.status_code == 200, r.text
        sid = r.json()["id"]

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            return await asyncio.gather(*[
                c.post(f"/v1/sessions/{sid}/append",
                       json={"text": word, "max_tokens": 30, "ignore_eos": True})
                for word in (" ALPHA", " BRAVO")])

    responses = asyncio.run(both())
    assert sorted(r.status_code for r in responses) == [200, 409], [r.text for r in responses]
    accepted, refused = (" ALPHA", " BRAVO") if responses[0].status_code == 200 else (
        " BRAVO", " ALPHA")
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        text = c.get(f"/v1/sessions/{sid}").json()["text"]
        assert accepted in text and refused not in text, text
        assert c.delete(f"/v1/sessions/{sid}").status_code == 200
    assert_clean(server)


def test_a_text_append_during_a_segment_is_not_part_of_its_output(server):
    """A text-only append made while a session generates goes into the session, never into
    the generating call's tokens, text or usage (a 12-token segment once returned 19)."""
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        sid = c.post("/v1/sessions", json={"prompt": "Once upon a time"}).json()["id"]
        appended = []
        with c.stream("POST", f"/v1/sessions/{sid}/generate",
                      json={"max_tokens": 40, "ignore_eos": True, "stream": True,
                            "temperature": 0}) as stream:
            final = None
            for line in stream.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event["object"] == "session.generation.chunk" and not appended:
                    r = c.post(f"/v1/sessions/{sid}/append", json={"text": " ZEBRA"})
                    assert r.status_code == 200, r.text
                    appended.append(r.json()["appended_tokens"])
                if event["object"] == "session.generation":
                    final = event
        assert appended and final is not None
        assert len(final["token_ids"]) == 40 and final["usage"]["completion_tokens"] == 40
        assert "ZEBRA" not in final["text"]
        view = c.get(f"/v1/sessions/{sid}").json()
        assert "ZEBRA" in view["text"]
        # The session holds its prompt, the 40 generated tokens and the fragment's tokens.
        assert view["num_tokens"] == view["num_prompt_tokens"] + 40 + appended[0]
        assert c.delete(f"/v1/sessions/{sid}").status_code == 200
    assert_clean(server)


def _json_headers(key: str) -> dict[str, str]:
    return {**_auth(key), "Content-Type": "application/json"}


def _pieces(data: bytes, size: int):
    for i in range(0, len(data), size):
        yield data[i:i + size]


BIG_BODY = json.dumps({"model": MODEL, "prompt": "Once", "max_tokens": 1,
                       "user": "x" * 3000}).encode()


def test_request_body_limit(secure):
    with httpx.Client(base_url=secure.base_url, timeout=30) as c:
        r = c.post("/v1/completions", content=BIG_BODY, headers=_json_headers("k1"))
        assert int(r.request.headers["content-length"]) > 2000
        assert_error(r, 413)
        # The limit applies before authentication too.
        r = c.post("/v1/completions", content=BIG_BODY,
                   headers={"Content-Type": "application/json"})
        assert_error(r, 413)
        # Just under the limit is fine, with a length or chunked.
        small = json.dumps({"model": MODEL, "prompt": "Once", "max_tokens": 1,
                            "user": "x" * 1800}).encode()
        assert 1800 < len(small) <= 2000
        for content in (small, _pieces(small, 700)):
            r = c.post("/v1/completions", content=content, headers=_json_headers("k1"))
            assert r.status_code == 200, r.text
    assert_clean(secure)


def test_request_body_limit_chunked(secure):
    with httpx.Client(base_url=secure.base_url, timeout=30) as c:
        r = c.post("/v1/completions", content=_pieces(BIG_BODY, 500),
                   headers=_json_headers("k1"))
        assert "content-length" not in r.request.headers
        assert r.request.headers["transfer-encoding"] == "chunked"
        try:
            assert_error(r, 413)
        finally:
            completion_ok = c.post("/v1/completions", headers=_auth("k1"), json={
                "model": MODEL, "prompt": "Once", "max_tokens": 1})
            assert completion_ok.status_code == 200
            assert_clean(secure)


def test_max_tokens_cap(secure):
    k1 = _auth("k1")
    with httpx.Client(base_url=secure.base_url, timeout=30) as c:
        r = c.post("/v1/completions", headers=k1, json={
            "model": MODEL, "prompt": "Once upon", "max_tokens": 9})
        error = assert_error(r, 400, param="max_tokens")
        assert "max_tokens" in error["message"]
        r = c.post("/v1/chat/completions", headers=k1, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 9})
        assert_error(r, 400, param="max_tokens")
        r = c.post("/v1/completions", headers=k1, json={
            "model": MODEL, "prompt": "Once upon", "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        # Without max_tokens the cap is the default.
        r = c.post("/v1/completions", headers=k1, json={
            "model": MODEL, "prompt": "Once upon", "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert_clean(secure)


PREFLIGHT = {"Origin": "http://a.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_cors_off_by_default(server, client):
    r = client.options("/v1/completions", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in r.headers
    r = client.get("/v1/models", headers={"Origin": "http://a.example"})
    assert r.status_code == 200
    assert "access-control-allow-origin" not in r.headers


def test_cors_allowed_origins(secure):
    with httpx.Client(base_url=secure.base_url, timeout=30) as c:
        r = c.options("/v1/completions", headers=PREFLIGHT)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://a.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        r = c.get("/v1/models", headers={"Origin": "http://a.example", **_auth("k1")})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://a.example"
        # Another origin gets no grant.
        r = c.options("/v1/completions", headers={**PREFLIGHT, "Origin": "http://b.example"})
        assert r.headers.get("access-control-allow-origin") != "http://b.example"
        r = c.get("/v1/models", headers={"Origin": "http://b.example", **_auth("k1")})
        assert "access-control-allow-origin" not in r.headers


# ---- 4. bad input --------------------------------------------------------------------------


def _completion_body(**fields):
    return {"model": MODEL, "prompt": "Once upon", "max_tokens": 2, **fields}


def _over_context(srv) -> dict:
    n = srv.llm_engine.config.max_model_len + 1
    return _completion_body(prompt=[3 + i % 500 for i in range(n)])


# (name, method, path, body or callable(server) -> body or raw bytes, status, code, param,
#  words the message must contain)
BAD_INPUT = [
    ("malformed json", "POST", "/v1/completions", b'{"model": "test-model", "prompt": ',
     400, "invalid_value", None, ["malformed JSON"]),
    ("not an object", "POST", "/v1/completions", b"[1, 2]", 400, None, None, []),
    ("empty body", "POST", "/v1/completions", b"", 400, None, None, []),
    ("unknown field", "POST", "/v1/completions", _completion_body(max_tokenz=3),
     400, "invalid_value", "max_tokenz", ["max_tokenz"]),
    ("unknown chat field", "POST", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi", "colour": "red"}]},
     400, "invalid_value", None, ["colour"]),
    ("mistyped max_tokens", "POST", "/v1/completions", _completion_body(max_tokens="many"),
     400, "invalid_value", "max_tokens", ["max_tokens"]),
    ("mistyped stream", "POST", "/v1/completions", _completion_body(stream="yes please"),
     400, "invalid_value", "stream", ["stream"]),
    ("missing prompt", "POST", "/v1/completions", {"model": MODEL},
     400, "invalid_value", "prompt", ["prompt"]),
    ("temperature too high", "POST", "/v1/completions", _completion_body(temperature=3.5),
     400, "invalid_value", "temperature", ["temperature"]),
    ("negative temperature", "POST", "/v1/completions", _completion_body(temperature=-1),
     400, "invalid_value", "temperature", ["temperature"]),
    ("top_p zero", "POST", "/v1/completions", _completion_body(top_p=0),
     400, "invalid_value", "top_p", ["top_p"]),
    ("top_p above one", "POST", "/v1/completions", _completion_body(top_p=1.5),
     400, "invalid_value", "top_p", ["top_p"]),
    ("n zero", "POST", "/v1/completions", _completion_body(n=0),
     400, "invalid_value", "n", ["'n'"]),
    ("n too many", "POST", "/v1/completions", _completion_body(n=17),
     400, "invalid_value", "n", ["'n'"]),
    ("max_tokens zero", "POST", "/v1/completions", _completion_body(max_tokens=0),
     400, "invalid_value", "max_tokens", ["max_tokens"]),
    ("empty prompt", "POST", "/v1/completions", _completion_body(prompt=""),
     400, None, "prompt", ["prompt"]),
    ("empty prompt ids", "POST", "/v1/completions", _completion_body(prompt=[]),
     400, None, "prompt", ["prompt"]),
    ("empty prompt in a batch", "POST", "/v1/completions", _completion_body(prompt=["a", ""]),
     400, None, "prompt", ["prompt"]),
    ("token id out of vocab", "POST", "/v1/completions", _completion_body(prompt=[5, 10**6]),
     400, None, "prompt", ["prompt"]),
    ("prompt over the context", "POST", "/v1/completions", _over_context,
     400, "context_length_exceeded", "prompt", ["context"]),
    ("max_tokens over the context", "POST", "/v1/completions",
     lambda srv: _completion_body(max_tokens=srv.llm_engine.config.max_model_len),
     400, "context_length_exceeded", "max_tokens", ["max_tokens"]),
    ("unknown model", "POST", "/v1/completions", _completion_body(model="gpt-17"),
     404, "model_not_found", "model", ["gpt-17"]),
    ("unknown model in chat", "POST", "/v1/chat/completions",
     {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]},
     404, "model_not_found", "model", ["gpt-17"]),
    ("no messages", "POST", "/v1/chat/completions", {"model": MODEL, "messages": []},
     400, "invalid_value", "messages", ["messages"]),
    ("bad role", "POST", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
     400, "invalid_value", None, ["role"]),
    ("detokenize out of vocab", "POST", "/detokenize", {"tokens": [1, 10**9]},
     400, None, "tokens", ["token ids"]),
    ("tokenize neither", "POST", "/tokenize", {}, 400, None, "prompt", ["prompt"]),
    ("unknown session", "GET", "/v1/sessions/sess-unknown", None,
     404, "session_not_found", None, ["sess-unknown"]),
    ("unknown session generate", "POST", "/v1/sessions/sess-unknown/generate",
     {"max_tokens": 2}, 404, "session_not_found", None, []),
    ("unknown session delete", "DELETE", "/v1/sessions/sess-unknown", None,
     404, "session_not_found", None, []),
    ("session without prompt", "POST", "/v1/sessions", {}, 400, None, "prompt", ["prompt"]),
    ("unknown route", "GET", "/v1/nothing-here", None, 404, None, None, ["/v1/nothing-here"]),
    ("unknown route post", "POST", "/v2/completions", _completion_body(),
     404, None, None, []),
    ("wrong method", "GET", "/v1/completions", None, 405, None, None, []),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input(server, client, case):
    _, method, path, body, status, code, param, words = case
    if callable(body):
        body = body(server)
    kwargs = {}
    if isinstance(body, bytes):
        kwargs = {"content": body, "headers": {"Content-Type": "application/json"}}
    elif body is not None:
        kwargs = {"json": body}
    error = assert_error(client.request(method, path, **kwargs), status, code, param)
    for word in words:
        assert word in error["message"], error
    completion(client)  # the server keeps serving
    assert_clean(server)


def _session(client: httpx.Client, prompt: str = "Once upon a time") -> str:
    r = client.post("/v1/sessions", json={"prompt": prompt})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def test_bad_session_input(server, client):
    sid = _session(client)
    r = client.post(f"/v1/sessions/{sid}/append", json={"text": "a", "token_ids": [5]})
    assert_error(r, 400, param="text")
    assert_error(client.post(f"/v1/sessions/{sid}/append", json={}), 400, param="text")
    r = client.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 2, "n": 2})
    assert_error(r, 400, param="n")
    r = client.post(f"/v1/sessions/{sid}/append", json={"text": "a", "n": 2})
    assert_error(r, 400, param="n")
    r = client.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 2, "colour": 1})
    assert_error(r, 400, param="colour")
    r = client.post(f"/v1/sessions/{sid}/rewind", json={"num_tokens": 0})
    assert_error(r, 400, param="num_tokens")
    r = client.post(f"/v1/sessions/{sid}/rewind", json={"num_tokens": 10_000})
    assert 400 <= r.status_code < 500, r.text
    assert_error(r, r.status_code)
    r = client.post(f"/v1/sessions/{sid}/append", json={"token_ids": [-1]})
    assert_error(r, 400, param="token_ids")
    assert_error(client.post("/v1/sessions", json={"prompt": [5, 10**6]}), 400)
    # Still intact after all of that.
    view = client.get(f"/v1/sessions/{sid}").json()
    assert view["status"] == "PAUSED" and view["text"] == "Once upon a time"
    # Closed: 404 everywhere, as unknown.
    assert client.delete(f"/v1/sessions/{sid}").status_code == 200
    for method, path, body in [("GET", "", None), ("DELETE", "", None),
                               ("POST", "/generate", {"max_tokens": 2}),
                               ("POST", "/append", {"text": "x"})]:
        r = client.request(method, f"/v1/sessions/{sid}{path}", json=body)
        assert_error(r, 404, code="session_not_found")
    completion(client)
    assert_clean(server)


def test_session_append_out_of_vocab(server, client):
    sid = _session(client)
    try:
        r = client.post(f"/v1/sessions/{sid}/append", json={"token_ids": [5, 10**6]})
        assert_error(r, 400)
        completion(client)  # other clients are unaffected
    finally:
        with httpx.Client(base_url=server.base_url, timeout=30) as c:
            c.delete(f"/v1/sessions/{sid}")
            completion(c)
        assert_clean(server)


@pytest.fixture(scope="module")
def no_template(tiny_models):
    with run_server(engine_args(tiny_models, num_kv_blocks=64)) as srv:
        yield srv


def test_chat_without_template(tiny_models, no_template):
    from loom.tokenizer import ChatTemplate

    folder, _ = tiny_models["gemma3"]
    assert ChatTemplate.from_model(folder, folder) is None  # the tiny model has none of its own
    assert no_template.app.state.loom.chat_template is None
    messages = [{"role": "user", "content": "hi"}]
    with httpx.Client(base_url=no_template.base_url, timeout=30) as c:
        for path, body in [("/v1/chat/completions", {"model": MODEL, "messages": messages}),
                           ("/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                     "stream": True}),
                           ("/tokenize", {"messages": messages}),
                           ("/v1/sessions", {"messages": messages})]:
            error = assert_error(c.post(path, json=body), 400, code="no_chat_template")
            assert "--chat-template" in error["message"]
        completion(c)  # plain completions work without a template
    assert_clean(no_template)


# ---- 5. schemathesis ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_server(tiny_models):
    """Generation kept short: 4 tokens at most, a 128-token context."""
    with run_server(engine_args(tiny_models, max_model_len=128), chat_template=TEMPLATE,
                    max_tokens_cap=4) as srv:
        yield srv


def test_seed_out_of_range(fuzz_server):
    with httpx.Client(base_url=fuzz_server.base_url, timeout=30) as c:
        try:
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Once",
                                                "max_tokens": 1, "seed": 2**64})
            assert_error(r, 400, param="seed")
        finally:
            completion(c, max_tokens=1)
            assert_clean(fuzz_server)


def test_tiny_repetition_penalty_fails_only_its_request(fuzz_server):
    with httpx.Client(base_url=fuzz_server.base_url, timeout=30) as c:
        try:
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon",
                                                "max_tokens": 4, "repetition_penalty": 1e-300})
            assert r.status_code < 500, r.text
        finally:
            completion(c, max_tokens=1)
            assert_clean(fuzz_server)


def test_expired_session_leaves_nothing(fuzz_server):
    eng = fuzz_server.llm_engine
    with httpx.Client(base_url=fuzz_server.base_url, timeout=30) as c:
        r = c.post("/v1/sessions", json={"prompt": "Once upon", "ttl_s": 0.05})
        assert r.status_code == 200, r.text
        sid = r.json()["id"]
        time.sleep(0.2)
        completion(c, max_tokens=1)  # a step expires it
        assert wait_until(lambda: not eng.is_live(sid), 10)
        assert eng.table.ended.get(sid) == "expired"
        assert_clean(fuzz_server, timeout=1)


def _valid(case):
    """What the schema cannot say about a valid request: it names the served model (another
    name is only ever a 404), and an append gives exactly one of text and token_ids."""
    body = case.body
    if isinstance(body, dict):
        if isinstance(body.get("model"), str):
            body["model"] = MODEL
        if case.path.endswith("/append"):
            if body.get("text") is not None:
                body.pop("token_ids", None)
            elif not body.get("token_ids"):
                body["text"] = " and then"
    return case


def test_schemathesis_no_server_errors(fuzz_server):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    conformance = [status_code_conformance, content_type_conformance,
                   response_schema_conformance]
    base = fuzz_server.base_url
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/sessions",
            "/v1/sessions/{session_id}/generate"} <= paths, paths
    state = fuzz_server.app.state.loom
    seen: dict[str, list[int]] = {}
    failures: list[str] = []

    with httpx.Client(base_url=base, timeout=30) as c:
        for op in operations:
            path_parameters = None
            if "{session_id}" in op.path:  # a live session, so the fuzzing reaches the engine
                r = c.post("/v1/sessions", json={"prompt": "Once upon a time"})
                assert r.status_code == 200, r.text
                path_parameters = {"session_id": r.json()["id"]}
            for mode in (schemathesis.GenerationMode.POSITIVE,
                         schemathesis.GenerationMode.NEGATIVE):
                strategy = op.as_strategy(mode, path_parameters=path_parameters)
                if mode == schemathesis.GenerationMode.POSITIVE:
                    strategy = strategy.map(_valid)

                @settings(max_examples=15, deadline=None, derandomize=True, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(case=strategy)
                def run(case):
                    label = case.operation.label
                    try:
                        response = case.call(base_url=base, timeout=10)
                    except Exception as exc:  # no answer (recorded: raising would shrink)
                        failures.append(f"{label} {case.body!r:.500}: {exc!r}")
                        return
                    seen.setdefault(label, []).append(response.status_code)
                    if response.status_code >= 500:
                        failures.append(f"{label} {case.path_parameters or ''} "
                                        f"{case.body!r:.500}: {response.status_code} "
                                        f"{response.text[:300]}")
                    try:  # the answer is what the schema says: status, type, body
                        case.validate_response(response, checks=conformance)
                    except Exception as exc:
                        failures.append(f"{label} {case.body!r:.300}: {response.status_code} "
                                        f"contradicts the schema: {exc!s:.800}")

                try:
                    run()
                except Unsatisfiable:  # nothing to make invalid (an operation without input)
                    assert mode == schemathesis.GenerationMode.NEGATIVE, op.label
            for sid in list(state.session_owners):
                c.delete(f"/v1/sessions/{sid}")
    assert not failures, "\n".join(failures)
    # Valid requests did get through to the engine.
    assert 200 in seen["POST /v1/completions"], seen
    assert 200 in seen["POST /v1/chat/completions"], seen
    assert 200 in seen["POST /v1/sessions/{session_id}/generate"], seen
    assert 200 in seen["POST /v1/sessions/{session_id}/append"], seen
    assert_clean(fuzz_server, timeout=20)


def test_openapi_documents_the_statuses_the_server_answers(server, client):
    """No 422 (a malformed body is a 400 naming the field), and each route's errors with
    OpenAI's error body: what schema-driven clients and fuzzers read."""
    paths = client.get("/openapi.json").json()["paths"]
    statuses = {(path, method): set(op["responses"]) for path, ops in paths.items()
                for method, op in ops.items()}
    assert not any("422" in s for s in statuses.values())
    assert {"200", "400", "401", "404", "413", "503"} <= statuses[("/v1/completions", "post")]
    assert {"404", "409", "429"} <= statuses[("/v1/sessions/{session_id}/generate", "post")]
    assert {"404", "409"} <= statuses[("/v1/responses", "post")]
    error = paths["/v1/chat/completions"]["post"]["responses"]["400"]
    assert error["content"]["application/json"]["schema"]["$ref"].endswith("/Error")
    # Every route's 200 has a body schema (JSON, and the event stream where it streams).
    for (path, method), _ in statuses.items():
        ok = paths[path][method]["responses"]["200"]["content"]
        assert ok, (path, method)
        json_schema = ok.get("application/json", {}).get("schema")
        assert json_schema or "text/plain" in ok, (path, method)
    chat = paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert chat["application/json"]["schema"]["$ref"].endswith("/ChatCompletion")
    assert "text/event-stream" in chat
    assert "SessionGeneration" in json.dumps(
        paths["/v1/sessions/{session_id}/append"]["post"]["responses"]["200"])
    # And the server does answer a malformed body with a 400, not a 422.
    assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": 5}), 400)
