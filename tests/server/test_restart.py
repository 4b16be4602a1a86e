"""`loom serve` with a KV store, restarted: sessions (`/v1/sessions`) and stored responses
(`previous_response_id`) continue on the new server, their KV loaded from the store, with
the tokens the same conversation gives without the restart (the default mode, real Gemma 3
270M); ownership is kept (another key gets a 404), and a delete forgets them in the store."""

from __future__ import annotations

import pytest
from server.conftest import run_server, wait_until

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m"
GREEDY = {"temperature": 0, "max_output_tokens": 8}
KEYS = ("key-a", "key-b")


def engine_args(gemma_path, store):
    from loom.engine.config import EngineArgs

    return EngineArgs(model=str(gemma_path), num_kv_blocks=512, max_model_len=2048,
                      enable_prefix_caching=False,
                      kv_transfer_config={"kv_connector": "SharedStorageConnector",
                                          "kv_role": "kv_both",
                                          "kv_connector_extra_config": {
                                              "shared_storage_path": str(store)}})


def clients(server, key):
    return (openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0,
                          timeout=300),
            httpx.Client(base_url=server.base_url, timeout=300,
                         headers={"Authorization": f"Bearer {key}"}))


def segment(http, sid, text) -> list[int]:
    out = http.post(f"/v1/sessions/{sid}/append", json={
        "text": text, "max_tokens": 6, "temperature": 0})
    assert out.status_code == 200, out.text
    return out.json()["choices"][0]["token_ids"] if "choices" in out.json() else []


def test_sessions_and_responses_continue_after_a_restart(gemma_path, tmp_path):
    store = tmp_path / "kv"
    with run_server(engine_args(gemma_path, store), served_model_name=MODEL,
                    api_keys=KEYS) as first:
        client, http = clients(first, KEYS[0])
        sid = http.post("/v1/sessions", json={"prompt": "The knight's name was"}).json()["id"]
        segment(http, sid, " Sir")
        engine = first.llm_engine
        assert wait_until(lambda: engine.get_session(sid).status == "PAUSED")
        before = http.get(f"/v1/sessions/{sid}").json()
        r1 = client.responses.create(model=MODEL, input="Name three colours.", **GREEDY)
        assert wait_until(lambda: engine.get_session(r1.id).status == "PAUSED")
        # The turn without a restart (a fork of r1's session: r1 stays as it was).
        r2 = client.responses.create(model=MODEL, input="And three animals?",
                                     previous_response_id=r1.id, **GREEDY)
        http.close()

    with run_server(engine_args(gemma_path, store), served_model_name=MODEL,
                    api_keys=KEYS) as second:
        client, http = clients(second, KEYS[0])
        engine = second.llm_engine
        # Another key does not see the session, and asking restores nothing.
        _, other = clients(second, KEYS[1])
        assert other.get(f"/v1/sessions/{sid}").status_code == 404
        assert not engine.is_live(sid)
        assert other.get(f"/v1/responses/{r1.id}").status_code == 404
        other.close()

        after = http.get(f"/v1/sessions/{sid}")
        assert after.status_code == 200, after.text
        assert after.json()["token_ids"] == before["token_ids"]
        segment(http, sid, " and his horse")
        assert wait_until(lambda: engine.get_session(sid).status == "PAUSED")
        tokens = list(engine.get_session(sid).token_ids)
        loaded = engine.stats.kv_loaded_tokens
        assert loaded >= len(before["token_ids"]) - 16  # all but the last partial block
        # The same tokens as a fresh session over the saved ones and the fragment (a
        # token's logits do not depend on how its context reached the cache).
        fresh = http.post("/v1/sessions", json={"prompt": before["text"]}).json()["id"]
        assert http.get(f"/v1/sessions/{fresh}").json()["token_ids"] == before["token_ids"]
        segment(http, fresh, " and his horse")
        assert wait_until(lambda: engine.get_session(fresh).status == "PAUSED")
        assert list(engine.get_session(fresh).token_ids) == tokens

        assert client.responses.retrieve(r1.id).output_text == r1.output_text
        again = client.responses.create(model=MODEL, input="And three animals?",
                                        previous_response_id=r1.id, **GREEDY)
        assert again.output_text == r2.output_text
        assert again.usage.input_tokens == r2.usage.input_tokens
        assert again.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens - 16

        # Deletes forget them in the store too.
        assert http.delete(f"/v1/sessions/{sid}").status_code == 200
        kept = engine.session_store
        assert kept.load(sid) is None
        for rid in (r1.id, r2.id, again.id):
            assert http.delete(f"/v1/responses/{rid}").status_code == 200
        assert http.get(f"/v1/responses/{r1.id}").status_code == 404
        http.delete(f"/v1/sessions/{fresh}")
        http.close()
        assert wait_until(lambda: engine.kv_pool_all_free)
