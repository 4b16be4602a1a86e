"""A live session over one WebSocket (`/v1/sessions/{id}/ws`) on the real Gemma 3 270M:
generation streams as chunks and equals the HTTP route's; append, resample, rewind, stop
and close act on the same session; a refused message is an error event that changes
nothing and keeps the socket; other keys cannot connect; a client that leaves mid-segment
stops it and the session stays, paused."""

from __future__ import annotations

import json

import pytest
from server.conftest import run_server, wait_until

websockets = pytest.importorskip("websockets")
httpx = pytest.importorskip("httpx")
from websockets.sync.client import connect  # noqa: E402

pytestmark = pytest.mark.slow

KEYS = ("key-a", "key-b")


@pytest.fixture(scope="module")
def served(gemma_engine):
    with run_server(gemma_engine, api_keys=KEYS) as server, httpx.Client(
            base_url=server.base_url, timeout=300,
            headers={"Authorization": f"Bearer {KEYS[0]}"}) as http:
        yield server, http
    assert gemma_engine.kv_pool_all_free


def socket_url(server, sid, key=KEYS[0]):
    return f"{server.base_url.replace('http', 'ws')}/v1/sessions/{sid}/ws?api_key={key}"


def ask(ws, message):
    ws.send(json.dumps(message))
    return json.loads(ws.recv(timeout=300))


def until_whole(ws):
    """The events of one segment: its chunks, then the whole."""
    events = []
    while True:
        event = json.loads(ws.recv(timeout=300))
        events.append(event)
        if event["type"] in ("generation", "error"):
            return events


def open_session(http, prompt="The knight's name was"):
    out = http.post("/v1/sessions", json={"prompt": prompt})
    assert out.status_code == 200, out.text
    return out.json()["id"]


def test_a_session_over_one_socket(served):
    server, http = served
    engine = server.llm_engine
    sid, ref_sid = open_session(http), open_session(http)
    with connect(socket_url(server, sid)) as ws:
        ws.send(json.dumps({"type": "generate", "id": 1, "max_tokens": 6, "temperature": 0,
                            "ignore_eos": True}))
        events = until_whole(ws)
        whole = events[-1]
        assert whole["type"] == "generation" and whole["ref"] == 1
        chunks = [e for e in events if e["type"] == "generation.chunk"]
        assert chunks and all(e["ref"] == 1 for e in chunks)
        assert "".join(e["text"] for e in chunks) == whole["text"]
        assert [t for e in chunks for t in e["token_ids"]] == whole["token_ids"]
        # The HTTP route gives the same segment on a session over the same prompt.
        same = http.post(f"/v1/sessions/{ref_sid}/generate", json={
            "max_tokens": 6, "temperature": 0, "ignore_eos": True}).json()
        assert same["token_ids"] == whole["token_ids"] and same["text"] == whole["text"]

        appended = ask(ws, {"type": "append", "id": 2, "text": " and his horse"})
        assert appended["type"] == "appended" and appended["ref"] == 2
        assert appended["appended_tokens"] > 0
        view = ask(ws, {"type": "get"})
        assert view["type"] == "session" and view["token_ids"] == \
            list(engine.get_session(sid).token_ids)
        assert wait_until(lambda: engine.get_session(sid).status == "PAUSED")
        samples = ask(ws, {"type": "resample", "n": 2, "temperature": 0})
        assert samples["type"] == "samples" and len(samples["samples"]) == 2
        rewound = ask(ws, {"type": "rewind", "num_tokens": 2})
        assert rewound["num_tokens"] == view["num_tokens"] - 2

        # Refusals: an error event naming the problem, nothing changes, the socket stays.
        before = list(engine.get_session(sid).token_ids)
        for message, status, words in (
                ({"type": "append", "id": 9}, 400, "exactly one of text or token_ids"),
                ({"type": "fly"}, 400, "unknown message type"),
                ({"type": "generate", "temperature": "hot"}, 400, "temperature"),
                ({"type": "rewind", "num_tokens": 10_000}, 400, "can rewind"),
                ({"type": "append", "text": "x", "max_tokens": 2, "n": 2}, 400, "n must be 1")):
            error = ask(ws, message)
            assert error["type"] == "error" and error["status"] == status, error
            assert words in error["error"]["message"]
        ws.send("{not json")
        assert json.loads(ws.recv(timeout=60))["error"]["message"].startswith("malformed JSON")
        assert list(engine.get_session(sid).token_ids) == before

        # Stop mid-segment: the segment ends early and the session pauses.
        ws.send(json.dumps({"type": "append", "id": 3, "text": " Once", "max_tokens": 500,
                            "ignore_eos": True, "temperature": 0}))
        first = json.loads(ws.recv(timeout=300))
        assert first["type"] in ("generation.chunk", "generation")
        ws.send(json.dumps({"type": "stop", "id": 4}))
        seen = [first]
        while not {"stopped", "generation"} <= {e["type"] for e in seen}:
            seen.append(json.loads(ws.recv(timeout=300)))
        assert next(e for e in seen if e["type"] == "stopped")["stopped"] is True
        whole = next(e for e in seen if e["type"] == "generation")
        assert len(whole["token_ids"]) < 500
        assert wait_until(lambda: engine.get_session(sid).status == "PAUSED")

        closed = ask(ws, {"type": "close", "id": 5})
        assert closed["type"] == "closed" and closed["deleted"] is True
    assert http.get(f"/v1/sessions/{sid}").status_code == 404
    http.delete(f"/v1/sessions/{ref_sid}")


def test_other_keys_cannot_connect_and_leaving_stops_the_segment(served):
    """A wrong key is refused at the handshake; another key's session is the HTTP API's 404
    (an error event, then close code 4404: test_session_socket_edges.py)."""
    server, http = served
    engine = server.llm_engine
    sid = open_session(http)
    with pytest.raises(websockets.exceptions.InvalidStatus), \
            connect(socket_url(server, sid, "wrong")):
        pass
    with connect(socket_url(server, sid, KEYS[1])) as ws:
        event = json.loads(ws.recv(timeout=60))
        assert event["type"] == "error" and event["status"] == 404
    with connect(socket_url(server, sid)) as ws:
        ws.send(json.dumps({"type": "generate", "max_tokens": 1000, "ignore_eos": True}))
        json.loads(ws.recv(timeout=300))  # generating
    assert wait_until(lambda: engine.get_session(sid).status == "PAUSED", timeout=60)
    assert len(engine.get_session(sid).token_ids) < 1000
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200
