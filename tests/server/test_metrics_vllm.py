"""`GET /metrics` as vLLM's tools read it (issue 43), on a real server over the tiny Gemma 3
model: every generation path is counted (completions, chat, the Responses API, sessions),
vLLM's names carry vLLM's types and labels, and `GET /v1/models/{id}` answers as OpenAI's."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server.conftest import delete_stored_responses, engine_args, run_server, wait_until
from server.test_server_robustness import TEMPLATE

MODEL = "test-model"
LABELS = {"model_name": MODEL, "engine": "0"}
# vLLM's names (as the parser names families: counters without "_total") and their types.
VLLM_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
}


@pytest.fixture(scope="module")
def server(tiny_models):
    with run_server(engine_args(tiny_models, num_kv_blocks=512), chat_template=TEMPLATE,
                    served_model_name=MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def scrape(client: httpx.Client) -> dict:
    """family name -> (type, {(sample name, sorted labels): value})."""
    r = client.get("/metrics")
    assert r.status_code == 200
    return {f.name: (f.type, {(s.name, tuple(sorted(s.labels.items()))): s.value
                              for s in f.samples})
            for f in text_string_to_metric_families(r.text)}


def sample(families: dict, family: str, suffix: str = "", **labels) -> float:
    """One sample of a family (its name + `suffix`), labelled as vLLM labels."""
    key = (family + suffix, tuple(sorted({**LABELS, **labels}.items())))
    return families[family][1][key]


def increase(before: dict, after: dict, family: str, suffix: str = "", **labels) -> float:
    return sample(after, family, suffix, **labels) - sample(before, family, suffix, **labels)


def test_every_generation_path_is_counted_under_vllm_names(server, client):
    before = scrape(client)
    generated = 0
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time",
                                             "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200, r.text
    generated += r.json()["usage"]["completion_tokens"]
    r = client.post("/v1/responses", json={"model": MODEL, "input": "Name three colours.",
                                           "max_output_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    response = r.json()
    generated += response["usage"]["output_tokens"]
    r = client.post("/v1/responses", json={"model": MODEL, "input": "And animals?",
                                           "previous_response_id": response["id"],
                                           "max_output_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    generated += r.json()["usage"]["output_tokens"]
    sid = client.post("/v1/sessions", json={"prompt": "Once upon a time"}).json()["id"]
    for max_tokens in (3, 2):
        r = client.post(f"/v1/sessions/{sid}/generate",
                        json={"max_tokens": max_tokens, "ignore_eos": True})
        assert r.status_code == 200, r.text
        generated += len(r.json()["token_ids"])
    engine = server.llm_engine
    # Finished segments are counted when their session parks (after the answer went out).
    assert wait_until(lambda: engine.get_session(sid).status == "PAUSED")
    assert client.delete(f"/v1/sessions/{sid}").status_code == 200
    delete_stored_responses(server)
    assert wait_until(lambda: engine.kv_pool_all_free)

    after = scrape(client)
    assert increase(before, after, "vllm:generation_tokens", "_total") == generated
    assert increase(before, after, "vllm:prompt_tokens", "_total") > 0
    finished = sum(increase(before, after, "vllm:request_success", "_total",
                            finished_reason=reason)
                   for reason in ("stop", "length", "abort", "error"))
    assert finished == 5  # one completion, two responses, two session segments
    assert increase(before, after, "vllm:request_generation_tokens", "_sum") == generated
    for latency in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert increase(before, after, latency, "_count") == 5, latency  # one per segment


def test_latencies_counted_once_on_every_path(server, client):
    """TTFT and end-to-end latency come from the engine: a Responses turn and a session's
    generation each add one observation, and a chat completion one (not one more from its
    route)."""
    engine = server.llm_engine
    latencies = ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds")

    def settled() -> bool:  # every segment under way has finished or parked
        load = engine.load
        return load.num_running == load.num_waiting == 0

    def one_observation_each(call) -> None:
        before = scrape(client)
        call()
        assert wait_until(settled)
        after = scrape(client)
        for latency in latencies:
            assert increase(before, after, latency, "_count") == 1, latency
            assert increase(before, after, latency, "_sum") >= 0.0

    def chat() -> None:
        r = client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200, r.text

    def responses_turn() -> None:
        r = client.post("/v1/responses", json={"model": MODEL, "input": "Name a colour.",
                                               "max_output_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text

    sid = client.post("/v1/sessions", json={"prompt": "Once upon a time"}).json()["id"]
    assert wait_until(lambda: engine.get_session(sid).status == "PAUSED")

    def session_generation() -> None:
        r = client.post(f"/v1/sessions/{sid}/generate",
                        json={"max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200, r.text

    for call in (chat, responses_turn, session_generation):
        one_observation_each(call)
    assert client.delete(f"/v1/sessions/{sid}").status_code == 200
    delete_stored_responses(server)
    assert wait_until(lambda: engine.kv_pool_all_free)


def test_vllm_names_types_and_labels(client):
    families = scrape(client)
    for name, kind in VLLM_TYPES.items():
        assert name in families, name
        assert families[name][0] == kind, (name, families[name][0])
        label_sets = {dict(labels).get("model_name") for _, labels in families[name][1]}
        assert label_sets == {MODEL}, (name, label_sets)
    reasons = {dict(labels)["finished_reason"]
               for _, labels in families["vllm:request_success"][1]}
    assert {"stop", "length", "abort", "error"} <= reasons
    # Loom's own metrics (no vLLM name) keep Loom's prefix.
    assert families["loom:num_requests_paused"][0] == "gauge"
    assert not any(name.startswith("loom:") and name.removeprefix("loom:") in
                   {v.removeprefix("vllm:") for v in VLLM_TYPES} for name in families)
    text = client.get("/metrics").text
    assert f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}}' in text
    assert "# TYPE vllm:generation_tokens_total counter" in text


def test_retrieve_a_model(client):
    r = client.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200, r.text
    card = r.json()
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] > 0
    assert card == {**client.get("/v1/models").json()["data"][0], "created": card["created"]}
    for unknown in ("gpt-4o", "org/other-model"):
        r = client.get(f"/v1/models/{unknown}")
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert unknown in error["message"] and error["code"] == "model_not_found"
        assert error["type"] and error["param"] == "model"
