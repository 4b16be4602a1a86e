"""`loom serve` through the real `openai` client and plain HTTP: the same tokens as the
engine's offline API, streaming equal to non-streaming, and a madlibs session over HTTP
equal to the same session run through the engine."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from engine.helpers import run_to_completion
from server.conftest import run_server

from loom import LLM, SamplingParams
from loom.engine.config import EngineArgs
from loom.tokenizer import ChatTemplate
from loom.tokenizer.packaged_templates import GEMMA3_TEMPLATE, packaged_template_file

openai = pytest.importorskip("openai")

TEMPLATE = packaged_template_file(GEMMA3_TEMPLATE)
MODEL = "test-model"
PROMPTS = ["The quick brown fox", "Once upon a time in a land"]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say something about foxes."}]


def tiny_args(folder) -> EngineArgs:
    return EngineArgs(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=256,
                      block_size=4)


@pytest.fixture(scope="module")
def tiny(tiny_models):
    folder, _ = tiny_models["gemma3"]
    with run_server(tiny_args(folder), served_model_name=MODEL,
                    chat_template=str(TEMPLATE)) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        llm = LLM(**vars(tiny_args(folder)))
        yield server, client, llm
    assert server.llm_engine.kv_pool_all_free
    assert not server.engine._queues  # every finished request's output queue was dropped


def offline(llm, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs


def test_completions_equal_the_offline_api(tiny):
    _server, client, llm = tiny
    greedy = dict(max_tokens=8, temperature=0.0)
    response = client.completions.create(model=MODEL, prompt=PROMPTS, **greedy)
    assert [c.index for c in response.choices] == [0, 1]
    for choice, prompt in zip(response.choices, PROMPTS, strict=True):
        expected = offline(llm, prompt, **greedy)[0]
        assert choice.text == expected.text and choice.finish_reason == "length"
    prompt_tokens = sum(len(llm.tokenizer.encode(p, add_special_tokens=True)) for p in PROMPTS)
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 16
    ids = llm.tokenizer.encode(PROMPTS[0], add_special_tokens=True)
    by_ids = client.completions.create(model=MODEL, prompt=ids, **greedy)
    assert by_ids.choices[0].text == response.choices[0].text


def test_streaming_equals_non_streaming_with_usage(tiny):
    _, client, _ = tiny
    params = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=0.0)
    whole = client.completions.create(**params).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **params))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_n_and_seed_are_reproducible(tiny):
    _, client, llm = tiny
    params = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=1.0, n=3, seed=11)
    first = client.completions.create(**params)
    again = client.completions.create(**params)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    expected = offline(llm, PROMPTS[0], max_tokens=6, temperature=1.0, n=3, seed=11)
    assert [c.text for c in first.choices] == [o.text for o in expected]
    other = client.completions.create(**{**params, "seed": 12})
    assert [c.text for c in other.choices] != [c.text for c in first.choices]


def test_logprobs_and_stop(tiny):
    _, client, llm = tiny
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6,
                                         temperature=0.0, logprobs=2)
    logprobs = response.choices[0].logprobs
    expected = offline(llm, PROMPTS[0], max_tokens=6, temperature=0.0, logprobs=2)[0]
    assert len(logprobs.tokens) == 6 and all(len(top) <= 3 for top in logprobs.top_logprobs)
    for got, token_id, position in zip(logprobs.token_logprobs, expected.token_ids,
                                       expected.logprobs, strict=True):
        assert got == pytest.approx(position[token_id], abs=1e-5)
    text = response.choices[0].text
    stop = text[len(text) // 2:][:3]
    if stop.strip():
        cut = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6,
                                        temperature=0.0, stop=[stop]).choices[0]
        assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]


def test_logit_bias_forces_and_bans_tokens(tiny):
    """OpenAI's logit_bias (token id strings -> [-100, 100]) through the client: +100 makes
    a token every greedy choice, -100 keeps the unbiased first token out; out-of-range or
    non-id keys are 400s naming the field."""
    _server, client, llm = tiny
    greedy = dict(max_tokens=4, temperature=0.0)
    first = offline(llm, PROMPTS[0], **greedy)[0].token_ids[0]
    for bias in ({42: 100}, {first: -100}):
        expected = offline(llm, PROMPTS[0], logit_bias=bias, **greedy)[0]
        got = client.completions.create(model=MODEL, prompt=PROMPTS[0],
                                        logit_bias={str(t): v for t, v in bias.items()},
                                        **greedy)
        assert got.choices[0].text == expected.text
        if bias == {42: 100}:
            assert list(expected.token_ids) == [42] * 4
        else:
            assert expected.token_ids[0] != first
    for bad in ({"42": 101}, {"x": 1}, {str(10**9): 1}):
        with pytest.raises(openai.BadRequestError, match=r"logit_bias|token ids"):
            client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1,
                                      logit_bias=bad)


def test_fields_that_change_nothing_are_ignored_with_a_warning(tiny, caplog):
    """OpenAI clients send `store`, `metadata`, `service_tier`; vLLM's send
    `chat_template_kwargs`: accepted (a logged warning names them), the same tokens as
    without; a field that would change the result and is not supported stays a 400."""
    server, client, _llm = tiny
    base = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0.0)
    plain = httpx.post(f"{server.base_url}/v1/completions", json=base, timeout=60).json()
    with caplog.at_level("WARNING", logger="loom.server"):
        extra = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
            **base, "store": True, "metadata": {"run": "1"}, "service_tier": "auto",
            "chat_template_kwargs": {"enable_thinking": False}})
    assert extra.status_code == 200, extra.text
    assert extra.json()["choices"][0]["text"] == plain["choices"][0]["text"]
    assert any("metadata" in r.getMessage() and "store" in r.getMessage()
               for r in caplog.records)
    refused = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                         json={**base, "use_beam_search": True})
    assert refused.status_code == 400 and "use_beam_search" in refused.text
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                          store=False, metadata={"a": "b"})
    assert chat.choices[0].message is not None


def test_echo_prepends_the_prompt(tiny):
    _, client, _ = tiny
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4,
                                      temperature=0.0).choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4,
                                       temperature=0.0, echo=True).choices[0].text
    assert echoed == PROMPTS[0] + plain


def test_chat_through_the_template_equals_the_offline_api(tiny):
    _server, client, llm = tiny
    template = ChatTemplate.from_model(Path("."), Path("."), TEMPLATE)
    ids = template.render_ids(llm.tokenizer, MESSAGES)
    expected = offline(llm, ids, max_tokens=8, temperature=0.0)[0]
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                              temperature=0.0, logprobs=True, top_logprobs=2)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert response.usage.prompt_tokens == len(ids)
    assert len(choice.logprobs.content) == 8
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                            temperature=0.0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) \
        == expected.text


def test_models_tokenize_and_errors_through_the_client(tiny):
    server, client, llm = tiny
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=5)
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert tokens["tokens"] == llm.tokenizer.encode(PROMPTS[0], add_special_tokens=True)
    text = httpx.post(f"{server.base_url}/detokenize",
                      json={"tokens": tokens["tokens"][1:]}).json()["prompt"]
    assert text == PROMPTS[0]
    # curl -d sends a form content type: the body is still read as JSON.
    form = httpx.post(f"{server.base_url}/tokenize", content=b'{"prompt": "The quick"}',
                      headers={"content-type": "application/x-www-form-urlencoded"})
    assert form.status_code == 200 and form.json()["count"] > 0


def test_a_madlibs_session_over_http_equals_the_engine(tiny, tiny_models):
    """Open, generate, append, generate, append, generate: the same tokens and segment texts
    as the same operations on an engine."""
    server, _, _ = tiny
    folder, _ = tiny_models["gemma3"]
    engine = LLM(**vars(tiny_args(folder))).engine
    story = ["Once upon a time", " there lived a", ". One day the", " went to"]
    greedy = {"max_tokens": 5, "temperature": 0.0}

    http = httpx.Client(base_url=server.base_url, timeout=60)
    sid = http.post("/v1/sessions", json={"prompt": story[0]}).json()["id"]
    http_segments = [http.post(f"/v1/sessions/{sid}/generate", json=greedy).json()]
    for fragment in story[1:]:
        http_segments.append(
            http.post(f"/v1/sessions/{sid}/append", json={"text": fragment, **greedy}).json())
    http_view = http.get(f"/v1/sessions/{sid}").json()

    engine.add_request("s", story[0], session=True)
    run_to_completion(engine)
    engine.resume("s", SamplingParams(**greedy))
    run_to_completion(engine)
    for fragment in story[1:]:
        engine.append("s", fragment, SamplingParams(**greedy))
        run_to_completion(engine)
    view = engine.get_session("s")
    assert http_view["token_ids"] == list(view.token_ids) and http_view["text"] == view.text
    # Each segment is the 5 tokens generated after its fragment, and nothing else.
    tokens, start = list(view.token_ids), view.num_prompt_tokens
    for segment, fragment in zip(http_segments, story, strict=True):
        assert segment["finish_reason"] == "length" and len(segment["token_ids"]) == 5
        if fragment != story[0]:
            start += len(engine.tokenizer.encode(fragment, add_special_tokens=False))
        assert segment["token_ids"] == tokens[start : start + 5]
        start += 5
    assert fragment not in segment["text"]
    assert http.delete(f"/v1/sessions/{sid}").json()["deleted"] is True
    engine.close("s")
    assert server.llm_engine.kv_pool_all_free and engine.kv_pool_all_free


@pytest.mark.slow
def test_gemma_completions_and_chat_over_http_equal_the_engine(gemma_engine):
    """The real Gemma 3 270M behind the server: the openai client gets the engine's greedy
    text for a completion and for a chat through the Gemma 3 turn template."""
    template = ChatTemplate.from_model(gemma_engine.config.model_path,
                                       gemma_engine.config.tokenizer_path, TEMPLATE)
    chat_ids = template.render_ids(gemma_engine.tokenizer, MESSAGES)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    gemma_engine.add_request("plain", PROMPTS[1], greedy)
    gemma_engine.add_request("chat", chat_ids, greedy)
    expected = run_to_completion(gemma_engine)
    with run_server(gemma_engine, served_model_name="gemma3-270m",
                    chat_template=str(TEMPLATE)) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                               max_retries=0, timeout=120)
        text = client.completions.create(model="gemma3-270m", prompt=PROMPTS[1],
                                         max_tokens=12, temperature=0.0).choices[0].text
        chat = client.chat.completions.create(model="gemma3-270m", messages=MESSAGES,
                                              max_tokens=12, temperature=0.0)
    assert text == expected["plain"].outputs[0].text
    assert chat.choices[0].message.content == expected["chat"].outputs[0].text
    assert chat.usage.prompt_tokens == len(chat_ids)
    assert gemma_engine.kv_pool_all_free


def _tree_of(out) -> list:
    return [(c.outputs[0].token_ids, _tree_of(c)) for c in out.children]


def _http_tree(children) -> list:
    return [(c["token_ids"], _http_tree(c["children"])) for c in children]


def test_promise_children_come_back_in_the_response(tiny_models):
    """With promise/sync tokens configured, a completion's response carries the tree of
    children, equal to the engine's own tree. The tokens are ones the tiny model samples
    greedily, so the hook fires without a script."""
    from loom.engine.promise_sync import SpecialKwargs

    folder, _ = tiny_models["gemma3"]
    probe = LLM(**vars(tiny_args(folder)))
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    sampled = probe.generate([PROMPTS[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    promise = sampled[1]
    sync = next((t for t in sampled[2:] if t != promise), None)
    if sync is None:
        pytest.skip("the tiny model repeats one token: no distinct sync token")
    special = SpecialKwargs(promise_token_id=promise, sync_token_id=sync, child_max_tokens=3)
    args = EngineArgs(**{**vars(tiny_args(folder)), "special_kwargs": special})
    engine = LLM(**vars(args)).engine
    engine.add_request("r", PROMPTS[0], greedy)
    expected = run_to_completion(engine)["r"]
    assert expected.children, "the hook did not fire"
    with run_server(args, served_model_name=MODEL) as server:
        body = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.0}).json()
        assert body["choices"][0]["text"] == expected.outputs[0].text
        assert _http_tree(body["children"][0]) == _tree_of(expected)
        # Streamed, the tree comes in one chunk after the text.
        with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.0,
                "stream": True}) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: {")]
        trees = [e["children"] for e in events if "children" in e]
        assert len(trees) == 1 and _http_tree(trees[0][0]) == _tree_of(expected)
        assert "".join(c["text"] for e in events for c in e["choices"]) == (
            expected.outputs[0].text)
        assert server.llm_engine.kv_pool_all_free


def test_chat_template_kwargs_reach_the_template(tiny_models, tmp_path):
    """vLLM's `chat_template_kwargs` are the template's extra variables (on chat; the names
    Loom sets itself are refused)."""
    folder, _ = tiny_models["gemma3"]
    template = tmp_path / "shout.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
                        "{% if shout %} LOUDER AND LOUDER{% endif %}")
    with run_server(tiny_args(folder), served_model_name=MODEL,
                    chat_template=str(template)) as server:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 1}
        plain = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
        loud = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                          json={**body, "chat_template_kwargs": {"shout": True}})
        assert loud.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"]
        refused = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                             json={**body, "chat_template_kwargs": {"messages": []}})
        assert refused.status_code == 400 and "messages" in refused.json()["error"]["message"]
