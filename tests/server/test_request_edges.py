"""Request edges real clients hit (issue 43), on the tiny random-weight Gemma 3 model: text
with an unpaired surrogate is a 400 naming the field on every route, and no error ends a
kept-alive connection; a 405 names the allowed methods; error codes are strings; and the
published OpenAPI schema states what the server checks (exactly one of prompt or messages,
the vocabulary, the max_tokens cap, the served model, Responses input items, tool_choice
without tools)."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import httpx
import pytest
from server.conftest import engine_args, run_server

from loom.tokenizer.packaged_templates import GEMMA3_TEMPLATE, packaged_template_file

jsonschema = pytest.importorskip("jsonschema")

MODEL = "test-model"
CAP = 4
LONE = "x \ud800 y"  # json.dumps writes it as the escape "\ud800": valid JSON, no text


@pytest.fixture(scope="module")
def server(tiny_models):
    args = engine_args(tiny_models, max_model_len=128)
    with run_server(args, chat_template=str(packaged_template_file(GEMMA3_TEMPLATE)),
                    max_tokens_cap=CAP) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


@pytest.fixture
def session_id(client):
    r = client.post("/v1/sessions", json={"prompt": "Once upon a time"})
    assert r.status_code == 200, r.text
    yield r.json()["id"]
    client.delete(f"/v1/sessions/{r.json()['id']}")


class KeptAlive:
    """One HTTP/1.1 connection; `request` fails if the server closed it in between."""

    def __init__(self, base_url: str) -> None:
        url = urlsplit(base_url)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        self.sock = None

    def request(self, method: str, path: str, body: object = None
                ) -> tuple[int, dict[str, str], dict]:
        data = None if body is None else json.dumps(body).encode()
        self.conn.request(method, path, body=data,
                          headers={"Content-Type": "application/json"})
        response = self.conn.getresponse()
        payload = json.loads(response.read() or b"null")
        if self.sock is None:
            self.sock = self.conn.sock
        assert self.conn.sock is self.sock, "the server closed the kept-alive connection"
        return response.status, {k.lower(): v for k, v in response.getheaders()}, payload

    def assert_still_serving(self) -> None:
        status, _, body = self.request("POST", "/tokenize", {"prompt": "still here"})
        assert status == 200 and body["count"] > 0, body


def assert_error(status: int, body: dict, expected: int, param: str | None = None) -> dict:
    assert status == expected, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["code"], str), error
    if param is not None:
        assert error["param"] == param, error
    return error


# (route, body, the field the 400 names)
SURROGATES = [
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                              "messages": [{"role": "user", "content": LONE}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "stop": ["a", LONE],
                              "messages": [{"role": "user", "content": "hi"}]}, "stop.1"),
    ("/v1/completions", {"model": MODEL, "max_tokens": 2, "prompt": LONE}, "prompt"),
    ("/v1/completions", {"model": MODEL, "max_tokens": 2, "prompt": "hi", "user": LONE},
     "user"),
    ("/v1/responses", {"model": MODEL, "max_output_tokens": 2, "input": LONE}, "input"),
    ("/v1/responses", {"model": MODEL, "max_output_tokens": 2, "input": [
        {"type": "message", "role": "user", "content": LONE}]}, "input.0.content"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "metadata": {"\udc00": "x"}},
     "metadata.\\udc00"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    ("/v1/sessions", {"prompt": LONE}, "prompt"),
    ("/v1/sessions", {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    ("/v1/sessions/{sid}/append", {"text": LONE}, "text"),
    ("/v1/sessions/{sid}/generate", {"max_tokens": 2, "stop": LONE}, "stop"),
]


def test_unpaired_surrogates_are_a_400_naming_the_field(server, session_id):
    http = KeptAlive(server.base_url)
    for path, body, field in SURROGATES:
        status, _, answer = http.request("POST", path.format(sid=session_id), body)
        error = assert_error(status, answer, 400, param=field)
        assert "surrogate" in error["message"] and field in error["message"], error
        assert error["code"] == "invalid_value", error
        http.assert_still_serving()
    # The session was not touched by the refused append.
    status, _, view = http.request("GET", f"/v1/sessions/{session_id}")
    assert status == 200 and view["text"] == "Once upon a time", view


def test_an_unexpected_error_is_a_500_on_a_connection_that_stays(server):
    app = server.app

    async def broken() -> None:
        raise TypeError("TextInputSequence must be str")

    app.add_api_route("/test-broken", broken, methods=["POST"])
    http = KeptAlive(server.base_url)
    status, _, body = http.request("POST", "/test-broken", {})
    error = assert_error(status, body, 500)
    assert error["code"] == "internal_error" and "TextInputSequence" in error["message"]
    http.assert_still_serving()


def test_405_carries_allow_and_errors_have_string_codes(server):
    http = KeptAlive(server.base_url)
    status, headers, body = http.request("GET", "/v1/completions")
    assert_error(status, body, 405)
    assert headers["allow"] == "POST", headers
    # Two routes share the path: both methods are named (Starlette names the first only).
    status, headers, body = http.request("POST", "/v1/sessions/sess-x")
    assert body["error"]["code"] == "method_not_allowed"
    assert {m.strip() for m in headers["allow"].split(",")} == {"GET", "DELETE"}, headers
    status, _, body = http.request("POST", "/tokenize", {})
    assert_error(status, body, 400, param="prompt")
    status, _, body = http.request("GET", "/v1/nowhere")
    assert assert_error(status, body, 404)["code"] == "not_found"
    http.assert_still_serving()


# ---- the published schema -----------------------------------------------------------------


@pytest.fixture(scope="module")
def openapi(client):
    return client.get("/openapi.json").json()


def valid(openapi: dict, component: str, instance: object) -> bool:
    """Whether `instance` is valid under the named component schema."""
    schema = {"$ref": f"#/components/schemas/{component}", "components": openapi["components"]}
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_schema_says_exactly_one_of_prompt_or_messages(openapi, client):
    messages = [{"role": "user", "content": "hi"}]
    for component, path in (("TokenizeRequest", "/tokenize"),
                            ("SessionCreateRequest", "/v1/sessions")):
        assert not valid(openapi, component, {})
        assert not valid(openapi, component, {"prompt": None, "messages": None})
        assert not valid(openapi, component, {"prompt": "hi", "messages": messages})
        assert not valid(openapi, component, {"prompt": "hi", "tools": [
            {"type": "function", "function": {"name": "f"}}]})
        assert not valid(openapi, component, {"messages": []})
        assert valid(openapi, component, {"prompt": "hi"})
        assert valid(openapi, component, {"messages": messages, "prompt": None})
        # And the server agrees on each.
        for body, status in (({}, 400), ({"prompt": "hi", "messages": messages}, 400),
                             ({"messages": []}, 400), ({"prompt": "hi"}, 200)):
            r = client.post(path, json=body)
            assert r.status_code == status, (path, body, r.text)
            if path == "/v1/sessions" and r.status_code == 200:
                client.delete(f"/v1/sessions/{r.json()['id']}")


def test_schema_states_the_servers_limits(server, openapi, client, session_id):
    vocab = server.llm_engine.inputs.vocab_size
    assert valid(openapi, "DetokenizeRequest", {"tokens": [vocab - 1]})
    assert not valid(openapi, "DetokenizeRequest", {"tokens": [vocab]})
    assert not valid(openapi, "CompletionRequest", {"model": MODEL, "prompt": [1, vocab]})
    assert not valid(openapi, "CompletionRequest", {"model": MODEL, "prompt": []})
    assert not valid(openapi, "CompletionRequest", {"model": "gpt-17", "prompt": "hi"})
    assert not valid(openapi, "ChatCompletionRequest", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "logit_bias": {str(vocab): 1}})
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert valid(openapi, "ChatCompletionRequest", {**chat, "max_tokens": CAP})
    assert not valid(openapi, "ChatCompletionRequest", {**chat, "max_tokens": CAP + 1})
    assert not valid(openapi, "ChatCompletionRequest", {**chat, "tool_choice": "required"})
    assert not valid(openapi, "ResponsesRequest", {"input": [{"content": "hi"}]})
    assert valid(openapi, "ResponsesRequest", {"input": [{"role": "user", "content": "hi"}]})
    assert not valid(openapi, "ResponsesRequest", {"input": "hi", "tool_choice": "auto"})
    assert not valid(openapi, "SessionAppendRequest", {})
    assert not valid(openapi, "SessionAppendRequest", {"text": "a", "token_ids": [1]})
    assert valid(openapi, "SessionAppendRequest", {"token_ids": [1]})
    error = openapi["components"]["schemas"]["Error"]["properties"]["error"]
    assert error["properties"]["code"] == {"type": "string"}
    # No mark of a limit is left for a client to puzzle over.
    assert "x-loom-limit" not in json.dumps(openapi)
    # And the server refuses what the schema refuses.
    for path, body in (("/v1/chat/completions", {**chat, "max_tokens": CAP + 1}),
                       ("/v1/chat/completions", {**chat, "tool_choice": "required"}),
                       ("/v1/responses", {"input": [{"content": "hi"}]}),
                       ("/v1/responses", {"input": "hi", "tool_choice": "auto"}),
                       ("/detokenize", {"tokens": [10**6]}),
                       ("/v1/chat/completions", {**chat, "logit_bias": {"\u00b2": 1}}),
                       (f"/v1/sessions/{session_id}/append", {"text": ""})):
        r = client.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
