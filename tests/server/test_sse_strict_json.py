"""Every SSE event the server sends is strict JSON (RFC 8259): a logprob of -inf (a token a
constraint forbids, among the top logprobs asked for) is `null`, never `-Infinity`, in the
chat and completions streams, a session's segment stream and the Responses stream, as on
the session WebSocket (one helper, `loom.server.wire.json_text`). On the tiny random-weight
Gemma 3 model."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from server.conftest import engine_args, run_server

from loom.server.response_routes import _sse as responses_sse
from loom.server.responses import sse
from loom.server.wire import json_text

# Two choices leave a handful of allowed first tokens: asking for more top logprobs than
# that brings in forbidden ones, at -inf.
CONSTRAINT = {"choice": ["alpha", "beta"]}
TOP = 20
MODEL = "test-model"  # run_server's served model name
# The tiny model has no chat template of its own.
TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def _refuse(name: str) -> float:
    raise ValueError(f"not JSON: {name}")


def strict(text: str) -> object:
    """`text` parsed as strict JSON: NaN, Infinity and -Infinity are refused."""
    return json.loads(text, parse_constant=_refuse)


def data_events(text: str) -> list[object]:
    """The `data:` payloads of an SSE stream, each parsed strictly ([DONE] left out)."""
    payloads = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert payloads, text
    return [strict(p) for p in payloads if p != "[DONE]"]


def nulls(value: object) -> int:
    """How many nulls `value` holds, anywhere."""
    if value is None:
        return 1
    if isinstance(value, dict):
        return sum(nulls(v) for v in value.values())
    if isinstance(value, list):
        return sum(nulls(v) for v in value)
    return 0


@pytest.fixture(scope="module")
def served(tiny_models):
    args = engine_args(tiny_models, num_kv_blocks=128, max_model_len=128)
    with run_server(args, chat_template=TEMPLATE) as server, httpx.Client(
            base_url=server.base_url, timeout=120) as http:
        yield server, http
    assert server.llm_engine.kv_pool_all_free


def test_the_helpers_write_non_finite_floats_as_null() -> None:
    event = {"type": "response.output_text.delta", "logprobs": [
        {"token": "a", "logprob": -math.inf, "top_logprobs": [{"logprob": math.nan}]}],
        "text": "é"}
    for text in (json_text(event), sse(event)[len("data: "):], responses_sse(event)):
        assert "Infinity" not in text and "NaN" not in text and "é" in text, text
    assert strict(json_text(event))["logprobs"][0]["logprob"] is None
    assert responses_sse(event).startswith("event: response.output_text.delta\ndata: ")
    assert strict(responses_sse(event).split("data: ", 1)[1])["logprobs"][0] == {
        "token": "a", "logprob": None, "top_logprobs": [{"logprob": None}]}


def test_a_streamed_completion_with_forbidden_top_logprobs_is_strict_json(served) -> None:
    _, http = served
    r = http.post("/v1/completions", json={
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0,
        "logprobs": TOP, "structured_outputs": CONSTRAINT, "stream": True})
    assert r.status_code == 200, r.text
    events = data_events(r.text)
    tops = [top for e in events for c in e["choices"] if c.get("logprobs")
            for top in c["logprobs"]["top_logprobs"]]
    assert tops and any(lp is None for top in tops for lp in top.values()), tops


def test_a_streamed_chat_completion_with_forbidden_top_logprobs_is_strict_json(served) -> None:
    _, http = served
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Once upon a time"}],
        "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": TOP,
        "structured_outputs": CONSTRAINT, "stream": True})
    assert r.status_code == 200, r.text
    events = data_events(r.text)
    tops = [t["logprob"] for e in events for c in e["choices"] if c.get("logprobs")
            for entry in c["logprobs"]["content"] for t in entry["top_logprobs"]]
    assert tops and None in tops, tops


def test_a_streamed_session_segment_with_forbidden_top_logprobs_is_strict_json(served) -> None:
    _, http = served
    opened = http.post("/v1/sessions", json={"prompt": "Once upon a time"})
    assert opened.status_code == 200, opened.text
    sid = opened.json()["id"]
    try:
        r = http.post(f"/v1/sessions/{sid}/generate", json={
            "max_tokens": 4, "temperature": 0, "logprobs": TOP,
            "structured_outputs": CONSTRAINT, "stream": True})
        assert r.status_code == 200, r.text
        assert nulls(data_events(r.text)) > 0, r.text
    finally:
        http.delete(f"/v1/sessions/{sid}")


def test_a_streamed_response_is_strict_json(served) -> None:
    _, http = served
    r = http.post("/v1/responses", json={
        "model": MODEL, "input": "Once upon a time", "max_output_tokens": 4,
        "temperature": 0, "store": False, "stream": True})
    assert r.status_code == 200, r.text
    events = data_events(r.text)
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
