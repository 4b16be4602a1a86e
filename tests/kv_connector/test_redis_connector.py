"""RedisConnector against a real `redis-server` (the `redis_server` fixture) on tiny models.

A producer engine saves a prompt's full blocks; a separate consumer engine loads them and
computes only the rest. Faults (a deleted key, the server stopped in the middle of a load,
a block saved for other KV or corrupted) must never change an output: with policy
"recompute" the failed blocks are computed like gaps, with "fail" only the request whose
load failed ends, with an error naming the block. Every test ends with the pool all free.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine.helpers import make_engine, prompt_ids
from tiny_reference import hf_greedy, hf_last_logits

from loom import SamplingParams
from loom.core.block_hash import extend_block_hashes
from loom.kv_connector import KVTransferConfig
from loom.kv_connector.codec import decode_block, encode_block

redis = pytest.importorskip("redis", reason="the redis client is not installed: pip install redis")

BLOCK = 4
PROMPT = prompt_ids(45)  # 11 full blocks of 4 (44 tokens the store can supply) and one token
OTHER = prompt_ids(23, 7)
NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1)
ATOL = 1e-4


def kv_config(server, role: str, policy: str = "recompute", **extra) -> KVTransferConfig:
    """The RedisConnector on the test's server."""
    return KVTransferConfig(
        kv_connector="RedisConnector",
        kv_role=role,
        kv_connector_extra_config={"host": server.host, "port": server.port, **extra},
        kv_load_failure_policy=policy,
    )


def client(server):
    return redis.Redis(host=server.host, port=server.port)


def block_key(spec, ids: list[int], index: int) -> str:
    """The store key of the index-th full block of `ids`, computed independently of the
    connector: "<fingerprint>/<chained block hash hex>"."""
    return f"{spec.fingerprint}/{extend_block_hashes([], ids, BLOCK, index + 1)[index].hex()}"


def drive(engine, max_steps: int = 500):
    """Step until nothing runs. Returns the last output of each request and, per step, the
    requests whose load ran in it and each chunk as (request id, start, end)."""
    last, steps = {}, []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return last, steps
        for out in engine.step():
            last[out.request_id] = out
        sched = engine.last_scheduler_output
        steps.append((list(sched.loading_request_ids),
                      [(c.request_id, c.start_pos, c.end_pos) for c in sched.chunks]))
    raise AssertionError("engine did not finish")


def first_steps_of(steps, rid: str, n: int) -> list:
    """The first n things that happened to `rid`: "load" or a chunk's (start, end)."""
    seen = []
    for loading, chunks in steps:
        seen += ["load"] * loading.count(rid)
        seen += [(start, end) for r, start, end in chunks if r == rid]
    return seen[:n]


def assert_equals_hf(hf, ids: list[int], output) -> None:
    """Greedy tokens equal transformers', and the first token's logprob equals its
    log-softmax of a fresh forward pass over the prompt (wrong K/V anywhere moves it)."""
    assert output.error is None
    completion = output.outputs[0]
    assert completion.token_ids == hf_greedy(hf, ids, NEW)
    token = completion.token_ids[0]
    expected = torch.log_softmax(hf_last_logits(hf, ids), -1)[token].item()
    assert completion.logprobs[0][token] == pytest.approx(expected, abs=ATOL)


def produce(folder, server, ids: list[int] = PROMPT):
    """A producer engine computes `ids` once (max_tokens=1) and saves its full blocks;
    returns its KV cache spec."""
    engine = make_engine(folder, kv_transfer_config=kv_config(server, "kv_producer"))
    engine.add_request("produce", ids, SamplingParams(temperature=0.0, max_tokens=1))
    outs, _ = drive(engine)
    assert outs["produce"].finished and outs["produce"].error is None
    stats = engine.stats
    assert stats.kv_saved_blocks == len(ids) // BLOCK
    assert stats.kv_loaded_tokens == 0  # a producer never looks up
    assert engine.kv_pool_all_free
    return engine.config.kv_cache_spec


def consumer(folder, server, policy: str = "recompute", role: str = "kv_consumer", **extra):
    return make_engine(folder, kv_transfer_config=kv_config(server, role, policy, **extra))


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_consumer_loads_what_a_producer_saved(tiny_models, redis_server, arch):
    folder, hf = tiny_models[arch]
    spec = produce(folder, redis_server)
    fingerprint = spec.fingerprint
    redis_client = client(redis_server)
    keys = {k.decode() for k in redis_client.scan_iter(match=f"{fingerprint}/*")}
    assert keys == {block_key(spec, PROMPT, i) for i in range(11)}
    assert redis_client.dbsize() == 11  # nothing else was written
    for i in (0, 10):  # what was stored is a valid block for this spec
        assert decode_block(redis_client.get(block_key(spec, PROMPT, i)), spec).shape == (
            spec.block_shape)

    # The "url" form of the address this time.
    engine = make_engine(folder, kv_transfer_config=KVTransferConfig(
        kv_connector="RedisConnector", kv_role="kv_consumer",
        kv_connector_extra_config={"url": redis_server.url}))
    assert engine.config.kv_cache_spec.fingerprint == fingerprint
    engine.add_request("c", PROMPT, GREEDY)
    outs, steps = drive(engine)
    # The load step computes nothing; the first chunk starts after the 44 loaded tokens.
    assert steps[0] == (["c"], [])
    assert steps[1][1][0] == ("c", 44, 45)
    assert_equals_hf(hf, PROMPT, outs["c"])
    stats = engine.stats
    assert (stats.kv_loaded_tokens, stats.kv_gap_tokens, stats.kv_load_failed_tokens) == (
        44, 0, 0)
    assert stats.kv_saved_blocks == 0 and redis_client.dbsize() == 11  # a consumer saves nothing
    assert engine.kv_pool_all_free


def test_blocks_of_another_model_are_not_looked_up(tiny_models, redis_server):
    """Keys start with the fingerprint: a llama consumer never sees gemma3's blocks."""
    produce(tiny_models["gemma3"][0], redis_server)
    folder, hf = tiny_models["llama"]
    engine = consumer(folder, redis_server)
    engine.add_request("c", PROMPT, GREEDY)
    outs, steps = drive(engine)
    assert steps[0] == ([], [("c", 0, 45)])
    assert_equals_hf(hf, PROMPT, outs["c"])
    assert engine.stats.kv_loaded_tokens == 0 and engine.kv_pool_all_free


def delete_after_lookup(monkeypatch, engine, server, key: str) -> None:
    """Delete `key` from Redis right after the scheduler matched it and queued its load (so
    the lookup said "held" and the worker's GET finds nothing)."""
    connector = engine.scheduler.connector
    original = connector.update_state_after_alloc

    def update_state_after_alloc(request, blocks, num_external_tokens):
        original(request, blocks, num_external_tokens)
        if num_external_tokens:
            assert client(server).delete(key) == 1

    monkeypatch.setattr(connector, "update_state_after_alloc", update_state_after_alloc)


def test_block_missing_at_load_is_recomputed(tiny_models, redis_server, monkeypatch):
    folder, hf = tiny_models["gemma3"]
    spec = produce(folder, redis_server)
    engine = consumer(folder, redis_server)
    delete_after_lookup(monkeypatch, engine, redis_server, block_key(spec, PROMPT, 5))
    engine.add_request("c", PROMPT, GREEDY)
    outs, steps = drive(engine)
    # Block 5 (tokens [20, 24)) becomes a gap; the frontier then jumps over [24, 44).
    assert first_steps_of(steps, "c", 3) == ["load", (20, 24), (44, 45)]
    assert_equals_hf(hf, PROMPT, outs["c"])
    stats = engine.stats
    assert (stats.kv_loaded_tokens, stats.kv_gap_tokens, stats.kv_load_failed_tokens) == (
        40, 4, 4)
    assert engine.kv_pool_all_free


def test_block_missing_at_load_fails_only_its_request(tiny_models, redis_server, monkeypatch):
    folder, hf = tiny_models["gemma3"]
    spec = produce(folder, redis_server)
    engine = consumer(folder, redis_server, policy="fail")
    key = block_key(spec, PROMPT, 5)
    delete_after_lookup(monkeypatch, engine, redis_server, key)
    engine.add_request("c", PROMPT, GREEDY)
    engine.add_request("o", OTHER, GREEDY)  # nothing stored for it: computes, concurrently
    outs, steps = drive(engine)
    assert steps[0] == (["c"], [("o", 0, 23)])
    failed = outs["c"]
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert failed.outputs[0].token_ids == []
    assert first_steps_of(steps, "c", 2) == ["load"]  # failed at once, computed nothing
    assert "[20, 24)" in failed.error and key in failed.error and "missing" in failed.error
    assert_equals_hf(hf, OTHER, outs["o"])
    assert engine.stats.kv_load_failed_tokens == 4
    assert engine.kv_pool_all_free


def test_redis_stopped_during_a_load(tiny_models, redis_server, monkeypatch, caplog):
    """The server dies after the first block of a load was read: the other ten fail and are
    computed; a later request, with Redis still down, computes everything. kv_both, so the
    saves that each step asks for also meet the dead server."""
    folder, hf = tiny_models["gemma3"]
    produce(folder, redis_server)
    # RedisStore does not retry by default (redis-py's own default, 3 retries with backoff
    # from 1 s, made this test take 47 s).
    engine = consumer(folder, redis_server, role="kv_both")
    store = engine.runner.kv_connector.store
    original_get = store.get
    read = []

    def get(key):
        value = original_get(key)
        read.append(key)
        if len(read) == 1:
            redis_server.stop()
        return value

    monkeypatch.setattr(store, "get", get)
    engine.add_request("c", PROMPT, GREEDY)
    outs, steps = drive(engine)
    assert not redis_server.running and len(read) == 1  # the 10 other GETs raised
    assert first_steps_of(steps, "c", 2) == ["load", (4, 45)]
    assert_equals_hf(hf, PROMPT, outs["c"])
    stats = engine.stats
    assert (stats.kv_loaded_tokens, stats.kv_gap_tokens, stats.kv_load_failed_tokens) == (
        4, 40, 40)
    assert stats.kv_saved_blocks == 0

    later = prompt_ids(45, 3)
    engine.add_request("later", later, GREEDY)
    caplog.clear()
    outs, steps = drive(engine)
    assert "KV store lookup failed, computing instead" in caplog.text
    assert steps[0] == ([], [("later", 0, 45)])  # the lookup failed: nothing to load
    assert_equals_hf(hf, later, outs["later"])
    after = engine.stats
    assert (after.kv_loaded_tokens, after.kv_gap_tokens, after.kv_load_failed_tokens) == (
        4, 40, 40)
    assert after.kv_saved_blocks == 0
    assert engine.kv_pool_all_free


def _payload_start(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


BAD_BLOCKS = {
    # kind of bad block planted under a key the consumer looks up -> the cause it names
    "other_fingerprint": "saved for other KV",
    "wrong_shape": "wrong shape",
    "wrong_dtype": "wrong dtype",
    "corrupt": "checksum mismatch",
}


def bad_block(kind: str, good: bytes, spec) -> bytes:
    """Bytes for the block's key that must not be loaded; their values are noise, so that
    loading them anyway would change the output."""
    noise = torch.Generator().manual_seed(0)
    if kind == "other_fingerprint":  # a whole, valid block of another KV layout
        other = replace(spec, block_size=8)
        return encode_block(torch.randn(other.block_shape, generator=noise), other)
    if kind == "wrong_shape":  # this spec's fingerprint on a block of 8 tokens
        shape = replace(spec, block_size=8).block_shape
        return encode_block(torch.randn(shape, generator=noise), spec)
    if kind == "wrong_dtype":
        return encode_block(torch.randn(spec.block_shape, generator=noise).half(), spec)
    assert kind == "corrupt"  # the good header and checksum over noise of the same size
    data = encode_block(torch.randn(spec.block_shape, generator=noise), spec)
    assert _payload_start(data) == _payload_start(good) and len(data) == len(good)
    return good[: _payload_start(good)] + data[_payload_start(data) :]


@pytest.mark.parametrize("kind", sorted(BAD_BLOCKS))
def test_unusable_block_is_recomputed(tiny_models, redis_server, monkeypatch, kind):
    folder, hf = tiny_models["gemma3"]
    spec = produce(folder, redis_server)
    key = block_key(spec, PROMPT, 3)
    redis_client = client(redis_server)
    redis_client.set(key, bad_block(kind, redis_client.get(key), spec))
    engine = consumer(folder, redis_server)
    worker = engine.runner.kv_connector
    original = worker.get_load_errors
    errors = []

    def get_load_errors():
        found = original()
        errors.extend(found.values())
        return found

    monkeypatch.setattr(worker, "get_load_errors", get_load_errors)
    engine.add_request("c", PROMPT, GREEDY)
    outs, steps = drive(engine)
    assert len(errors) == 1 and key in errors[0] and BAD_BLOCKS[kind] in errors[0]
    assert first_steps_of(steps, "c", 3) == ["load", (12, 16), (44, 45)]
    assert_equals_hf(hf, PROMPT, outs["c"])
    stats = engine.stats
    assert (stats.kv_loaded_tokens, stats.kv_gap_tokens, stats.kv_load_failed_tokens) == (
        40, 4, 4)
    assert engine.kv_pool_all_free
