"""`POST /v1/embeddings` through the real `openai` client and plain HTTP: the vectors equal
`LLM.embed`'s (float and base64), a batch of texts or of token ids, and OpenAI-style 400s
naming the field; no KV block is held afterwards."""

from __future__ import annotations

import base64
import struct

import httpx
import pytest
from engine.helpers import prompt_ids
from server.conftest import run_server

from loom import LLM, PoolingParams
from loom.engine.config import EngineArgs

openai = pytest.importorskip("openai")

MODEL = "test-model"
TEXTS = ["The quick brown fox", "Once upon a time in a land far away"]


def tiny_args(folder) -> EngineArgs:
    # The default mode's arithmetic (w8a8): an embedding is the same bits however it is
    # batched, so the server's equal the offline API's exactly.
    return EngineArgs(model=str(folder), dtype="float32", device="cpu", quantization="w8a8",
                      num_kv_blocks=256, block_size=4, max_model_len=64)


@pytest.fixture(scope="module")
def tiny(tiny_models):
    folder, _ = tiny_models["qwen3"]
    with run_server(tiny_args(folder), served_model_name=MODEL) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        llm = LLM(**vars(tiny_args(folder)))
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            yield server, client, http, llm
    assert server.llm_engine.kv_pool_all_free
    assert not server.engine._queues


def offline(llm, prompts, **params) -> list[list[float]]:
    return [o.outputs.embedding for o in llm.embed(prompts, PoolingParams(**params))]


def floats(embedding: list[float] | str) -> list[float]:
    """An embedding's values: floats as they are, base64 as little-endian float32."""
    if not isinstance(embedding, str):
        return [float(x) for x in embedding]
    raw = base64.b64decode(embedding)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def test_openai_client_float_and_base64(tiny):
    _server, client, _http, llm = tiny
    expected = offline(llm, TEXTS)
    for encoding in ("float", "base64"):  # asked for explicitly, base64 comes as text
        response = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format=encoding)
        assert [d.index for d in response.data] == [0, 1]
        for item, want in zip(response.data, expected, strict=True):
            assert item.object == "embedding"
            assert floats(item.embedding) == want
        tokens = sum(len(llm.tokenizer.encode(t, add_special_tokens=True)) for t in TEXTS)
        assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
        assert response.model == MODEL
    # Without encoding_format the client asks for base64 and decodes it itself.
    single = client.embeddings.create(model=MODEL, input=TEXTS[0])
    assert [float(x) for x in single.data[0].embedding] == expected[0]


def test_token_id_inputs_and_raw_base64(tiny):
    _server, client, http, llm = tiny
    ids = [prompt_ids(9), prompt_ids(17, 3)]
    expected = offline(llm, ids, pooling_type="mean", normalize=False)
    response = http.post("/v1/embeddings", json={
        "model": MODEL, "input": ids, "encoding_format": "base64", "pooling_type": "mean",
        "normalize": False})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["usage"]["prompt_tokens"] == 26
    for item, want in zip(body["data"], expected, strict=True):
        assert floats(item["embedding"]) == want
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert one.data[0].embedding == offline(llm, [ids[0]])[0]


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"input": ""}, "input", "at least 1 character"),
    ({"input": []}, "input", "empty"),
    ({"input": ["a", ""]}, "input", "empty"),
    ({"input": [[5, 10**6]]}, "input", "token ids"),
    ({"input": [prompt_ids(65)]}, "input", "context limit"),
    ({"input": "word " * 80}, "input", "context limit"),
    ({"input": "hi", "dimensions": 8}, "dimensions", "matryoshka"),
    ({"input": "hi", "dimensions": 0}, "dimensions", ""),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
    ({"input": "hi", "pooling_type": "cls"}, "pooling_type", ""),
])
def test_bad_requests_are_openai_style_400s(tiny, body, param, fragment):
    _server, _client, http, _llm = tiny
    response = http.post("/v1/embeddings", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"]


def test_unknown_model_is_a_404(tiny):
    _server, client, _http, _llm = tiny
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")


def test_a_matryoshka_model_takes_the_dimensions_it_lists(tiny_models):
    from dataclasses import replace

    from loom.engine.llm_engine import LLMEngine

    folder, _ = tiny_models["qwen3"]
    engine = LLMEngine.from_engine_args(tiny_args(folder))
    # As resolve derives it from a config with `matryoshka_dimensions: [4, 16]`.
    engine.config = replace(engine.config, embedding_dimensions=(4, 16))
    with run_server(engine, served_model_name=MODEL) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as http:
        schema = http.get("/openapi.json").json()["components"]["schemas"]
        field = schema["EmbeddingRequest"]["properties"]["dimensions"]
        assert {"type": "integer", "minimum": 1, "enum": [4, 16]} in field["anyOf"]
        ok = http.post("/v1/embeddings", json={"model": MODEL, "input": "hi", "dimensions": 4})
        assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 4
        bad = http.post("/v1/embeddings", json={"model": MODEL, "input": "hi", "dimensions": 8})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"
        assert "one of [4, 16]" in bad.json()["error"]["message"]
    assert engine.kv_pool_all_free
