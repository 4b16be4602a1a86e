"""The session WebSocket's edges (issue 43), on the tiny random-weight Gemma 3 model: a
binary frame is an error event and the socket goes on; an unknown, closed or another key's
session is the HTTP API's 404 (an error event, then close code 4404); errors say what is
wrong (only JSON that does not parse is "malformed JSON") with string codes; text with an
unpaired surrogate is a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import pytest
from server.conftest import engine_args, run_server

websockets = pytest.importorskip("websockets")
from websockets.sync.client import connect  # noqa: E402

KEYS = ("key-a", "key-b")
NOT_FOUND_CLOSE = 4404


@pytest.fixture(scope="module")
def served(tiny_models):
    args = engine_args(tiny_models, num_kv_blocks=128, max_model_len=128)
    with run_server(args, api_keys=KEYS) as server, httpx.Client(
            base_url=server.base_url, timeout=60,
            headers={"Authorization": f"Bearer {KEYS[0]}"}) as http:
        yield server, http
    assert server.llm_engine.kv_pool_all_free


def socket_url(server, sid, key=KEYS[0]):
    return f"{server.base_url.replace('http', 'ws')}/v1/sessions/{sid}/ws?api_key={key}"


def open_session(http) -> str:
    r = http.post("/v1/sessions", json={"prompt": "Once upon a time"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def receive(ws) -> dict:
    return json.loads(ws.recv(timeout=60))


def ask(ws, message) -> dict:
    ws.send(message if isinstance(message, str | bytes) else json.dumps(message))
    return receive(ws)


def assert_error_event(event: dict, status: int, code: str) -> dict:
    assert event["type"] == "error" and event["status"] == status, event
    error = event["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == code, error
    return error


def assert_not_found_then_closed(ws) -> None:
    """One 404 error event naming the session, then close code 4404."""
    error = assert_error_event(receive(ws), 404, "session_not_found")
    assert "unknown session" in error["message"], error
    with pytest.raises(websockets.exceptions.ConnectionClosed):
        ws.recv(timeout=60)
    assert ws.protocol.close_code == NOT_FOUND_CLOSE


def test_a_binary_frame_is_an_error_event_and_the_socket_goes_on(served):
    server, http = served
    sid = open_session(http)
    with connect(socket_url(server, sid)) as ws:
        error = assert_error_event(ask(ws, b'{"type": "get"}'), 400, "binary_frame")
        assert "text frame" in error["message"]
        view = ask(ws, {"type": "get", "id": 1})
        assert view["type"] == "session" and view["ref"] == 1 and view["id"] == sid
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200


def test_errors_say_what_is_wrong_with_string_codes(served):
    server, http = served
    sid = open_session(http)
    with connect(socket_url(server, sid)) as ws:
        error = assert_error_event(ask(ws, "{not json"), 400, "invalid_json")
        assert error["message"].startswith("malformed JSON")
        error = assert_error_event(ask(ws, "[1, 2]"), 400, "invalid_value")
        assert "JSON object" in error["message"]
        # A sampling parameter the engine refuses is not a JSON problem.
        error = assert_error_event(ask(ws, {"type": "generate", "id": 2, "logit_bias": {
            "x": 1}}), 400, "invalid_value")
        assert "logit_bias" in error["message"] and "JSON" not in error["message"], error
        error = assert_error_event(ask(ws, {"type": "fly"}), 400, "invalid_value")
        assert error["param"] == "type"
        event = ask(ws, {"type": "append", "text": "a", "token_ids": [5]})
        assert isinstance(assert_error_event(event, 400, "invalid_request")["code"], str)
        # Text with an unpaired surrogate: a 400 naming the field, anywhere in the message.
        for message, field in (('{"type": "append", "text": "a \\ud800"}', "text"),
                               ('{"type": "get", "id": "\\udfff"}', "id"),
                               ('{"type": "generate", "stop": ["\\ud800"]}', "stop.0")):
            error = assert_error_event(ask(ws, message), 400, "invalid_value")
            assert error["param"] == field and "surrogate" in error["message"], error
        view = ask(ws, {"type": "get"})
        assert view["type"] == "session" and view["text"] == "Once upon a time", view
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200


def test_unknown_closed_and_other_keys_sessions_are_not_found(served):
    server, http = served
    sid = open_session(http)
    for url in (socket_url(server, "sess-none"), socket_url(server, sid, KEYS[1])):
        with connect(url) as ws:
            assert_not_found_then_closed(ws)
    # A wrong key is still refused before the socket is accepted.
    with pytest.raises(websockets.exceptions.InvalidStatus), connect(
            socket_url(server, sid, "wrong")):
        pass
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200
    with connect(socket_url(server, sid)) as ws:  # closed
        assert_not_found_then_closed(ws)


def test_a_session_closed_elsewhere_ends_its_socket(served):
    server, http = served
    sid = open_session(http)
    with connect(socket_url(server, sid)) as ws:
        assert ask(ws, {"type": "get"})["type"] == "session"
        assert http.delete(f"/v1/sessions/{sid}").status_code == 200
        ws.send(json.dumps({"type": "get", "id": 7}))
        event = receive(ws)
        assert event["ref"] == 7
        ws_error = assert_error_event(event, 404, "session_not_found")
        assert sid in ws_error["message"]
        with pytest.raises(websockets.exceptions.ConnectionClosed):
            ws.recv(timeout=60)
        assert ws.protocol.close_code == NOT_FOUND_CLOSE
