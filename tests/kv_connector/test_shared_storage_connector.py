"""SharedStorageConnector on tiny models: K/V saved by one engine, loaded by another.

Every test checks the mission's invariant: whatever was loaded, lost or corrupt, the logits
and greedy tokens equal transformers' fresh forward pass, and closing leaves the pool free.
"""

from __future__ import annotations

import dataclasses
import sys
import textwrap

import pytest
import torch
from engine.helpers import make_engine, prompt_ids, run_to_completion
from tiny_reference import hf_greedy, hf_last_logits

from loom import SamplingParams
from loom.errors import InvalidRequestError, KVConnectorError
from loom.kv_connector import KVTransferConfig
from loom.kv_connector.codec import encode_block

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PREFILL = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
IDS = prompt_ids(45, 3)  # 11 full blocks of 4 before the last token
ATOL = 1e-4


def shared(path, role="kv_both", policy="recompute", **kwargs):
    return KVTransferConfig("SharedStorageConnector", kv_role=role,
                            kv_connector_extra_config={"shared_storage_path": str(path)},
                            kv_load_failure_policy=policy, **kwargs)


def produce(folder, store, ids=IDS):
    """A producer engine computes `ids` once (prefill and one token) and saves its blocks."""
    engine = make_engine(folder, kv_transfer_config=shared(store, "kv_producer"))
    engine.add_request("p", ids, PREFILL)
    run_to_completion(engine)
    assert engine.kv_pool_all_free
    return engine


def block_files(store):
    return sorted(store.rglob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns)


def consume(folder, store, policy="recompute", poison=True):
    """A fresh consumer engine, its KV pool filled with large noise so that any position it
    neither loads nor computes changes the output."""
    engine = make_engine(folder, kv_transfer_config=shared(store, "kv_consumer", policy))
    if poison:
        generator = torch.Generator().manual_seed(0)
        for cache in engine.runner.kv_caches:
            cache.copy_(torch.randn(cache.shape, generator=generator) * 100)
    return engine


def session_logits(engine, rid, ids):
    engine.add_request(rid, ids, session=True)
    run_to_completion(engine)
    return engine.get_logits(rid)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_a_consumer_loads_the_producers_kv_and_equals_transformers(tiny_models, tmp_path, arch):
    folder, hf = tiny_models[arch]
    produce(folder, tmp_path)
    assert len(block_files(tmp_path)) == 11
    engine = consume(folder, tmp_path)
    engine.add_request("c", IDS, GREEDY)
    engine.step()
    assert engine.last_scheduler_output.loading_request_ids == ["c"]
    engine.step()
    assert [c.start_pos for c in engine.last_scheduler_output.chunks] == [44]
    out = run_to_completion(engine)["c"]
    assert out.outputs[0].token_ids == hf_greedy(hf, IDS, 6)
    stats = engine.stats
    assert (stats.kv_loaded_tokens, stats.kv_gap_tokens, stats.kv_load_failed_tokens) == (44, 0, 0)
    assert stats.prefix_cache_hits == 0 and engine.kv_pool_all_free


def test_a_session_on_loaded_kv_alternates_prefill_and_generation(tiny_models, tmp_path):
    folder, hf = tiny_models["gemma3"]
    produce(folder, tmp_path)
    engine = consume(folder, tmp_path)
    stored = session_logits(engine, "s", IDS)
    torch.testing.assert_close(stored, hf_last_logits(hf, IDS), atol=ATOL, rtol=0)
    fragment = prompt_ids(7, 90)
    engine.append("s", fragment)
    run_to_completion(engine)
    ids = IDS + fragment
    torch.testing.assert_close(engine.get_logits("s"), hf_last_logits(hf, ids), atol=ATOL, rtol=0)
    assert engine.stats.kv_loaded_tokens == 44
    engine.close("s")
    assert engine.kv_pool_all_free


def test_blocks_missing_from_the_store_are_gaps_computed_exactly(tiny_models, tmp_path):
    folder, hf = tiny_models["gemma3"]
    produce(folder, tmp_path)
    files = block_files(tmp_path)  # in the order they were saved: block 0 first
    for index in (2, 5, 6):
        files[index].unlink()
    engine = consume(folder, tmp_path)
    stored = session_logits(engine, "s", IDS)
    torch.testing.assert_close(stored, hf_last_logits(hf, IDS), atol=ATOL, rtol=0)
    stats = engine.stats
    assert (stats.kv_loaded_tokens, stats.kv_gap_tokens) == (32, 12)
    assert stats.num_recomputed_tokens == 0
    engine.close("s")
    assert engine.kv_pool_all_free


def test_a_producer_saves_each_block_once_and_appended_fragments_too(tiny_models, tmp_path):
    folder, _ = tiny_models["gemma3"]
    engine = produce(folder, tmp_path)
    assert engine.stats.kv_saved_blocks == 11
    engine.add_request("again", IDS, PREFILL)
    run_to_completion(engine)
    assert engine.stats.kv_saved_blocks == 11  # the store had them all
    engine.add_request("s", IDS[:10], session=True)
    run_to_completion(engine)
    engine.append("s", IDS[10:] + prompt_ids(9, 5))
    run_to_completion(engine)
    assert engine.stats.kv_saved_blocks == 13  # two more full blocks after the prompt's
    engine.close("s")


def _fault(kind, path, spec):
    data = path.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "corrupt_header":
        path.write_bytes(b"\xff" * 8 + data[8:])
    elif kind == "checksum":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 0x55]))
    elif kind == "other_model":
        block = torch.zeros(spec.block_shape, dtype=torch.float32)
        path.write_bytes(encode_block(block, dataclasses.replace(spec, model_id="other")))
    elif kind == "other_dtype":
        block = torch.zeros(spec.block_shape, dtype=torch.bfloat16)
        path.write_bytes(encode_block(block, dataclasses.replace(spec, kv_cache_dtype="bfloat16")))
    elif kind == "wrong_shape":
        shape = (spec.num_layers, 2, spec.block_size * 2, spec.num_kv_heads, spec.head_dim)
        path.write_bytes(encode_block(torch.zeros(shape), spec))
    elif kind == "wrong_dtype_same_fingerprint":
        path.write_bytes(encode_block(torch.zeros(spec.block_shape, dtype=torch.float16), spec))


FAULTS = {
    "truncated": "truncated",
    "corrupt_header": "truncated block file",
    "checksum": "checksum mismatch",
    "other_model": "saved for other KV",
    "other_dtype": "saved for other KV",
    "wrong_shape": "wrong shape",
    "wrong_dtype_same_fingerprint": "wrong dtype",
}


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_a_bad_block_is_recomputed_and_counted(tiny_models, tmp_path, kind):
    folder, hf = tiny_models["gemma3"]
    producer = produce(folder, tmp_path)
    _fault(kind, block_files(tmp_path)[3], producer.config.kv_cache_spec)
    engine = consume(folder, tmp_path)
    engine.add_request("c", IDS, GREEDY)
    out = run_to_completion(engine)["c"]
    assert out.error is None and out.outputs[0].token_ids == hf_greedy(hf, IDS, 6)
    stats = engine.stats
    assert (stats.kv_loaded_tokens, stats.kv_load_failed_tokens, stats.kv_gap_tokens) == (40, 4, 4)
    assert engine.kv_pool_all_free


@pytest.mark.parametrize("kind", ["checksum", "other_model", "missing"])
def test_a_bad_block_under_fail_fails_only_its_request_naming_block_and_cause(
    tiny_models, tmp_path, kind
):
    folder, hf = tiny_models["gemma3"]
    producer = produce(folder, tmp_path)
    victim = block_files(tmp_path)[3]
    engine = consume(folder, tmp_path, policy="fail")
    if kind == "missing":  # gone between the lookup and the load
        connector = engine.scheduler.connector
        update = connector.update_state_after_alloc

        def update_then_lose(request, blocks, num_external_tokens):
            update(request, blocks, num_external_tokens)
            victim.unlink()

        connector.update_state_after_alloc = update_then_lose
    else:
        _fault(kind, victim, producer.config.kv_cache_spec)
    other = prompt_ids(9, 77)
    engine.add_request("bad", IDS, GREEDY)
    engine.add_request("fine", other, GREEDY)
    outs = run_to_completion(engine)
    assert outs["bad"].outputs[0].finish_reason == "error"
    message = outs["bad"].error
    cause = {"checksum": "checksum mismatch", "other_model": "saved for other KV",
             "missing": "missing from the store"}[kind]
    assert "'bad'" in message and "[12, 16)" in message and cause in message
    assert victim.stem in message  # the block's key names the file
    assert outs["fine"].outputs[0].token_ids == hf_greedy(hf, other, 6)
    assert engine.kv_pool_all_free
    engine.add_request("after", other, GREEDY)  # the engine goes on
    assert run_to_completion(engine)["after"].outputs[0].token_ids == hf_greedy(hf, other, 6)


def test_bad_connector_configuration_fails_at_start(tiny_models, tmp_path, monkeypatch):
    folder, _ = tiny_models["gemma3"]
    with pytest.raises(KVConnectorError, match="unknown KV connector 'NoSuchConnector'"):
        make_engine(folder, kv_transfer_config=KVTransferConfig("NoSuchConnector"))
    with pytest.raises(KVConnectorError, match="cannot import kv_connector_module_path"):
        make_engine(folder, kv_transfer_config=KVTransferConfig(
            "X", kv_connector_module_path="no_such_module_here"))
    (tmp_path / "my_connectors.py").write_text(textwrap.dedent("""
        class NotAConnector:
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KVConnectorError, match="no KV connector class 'NotAConnector'"):
        make_engine(folder, kv_transfer_config=KVTransferConfig(
            "NotAConnector", kv_connector_module_path="my_connectors"))
    sys.modules.pop("my_connectors", None)
    with pytest.raises(InvalidRequestError, match="kv_role"):
        KVTransferConfig("SharedStorageConnector", kv_role="kv_sideways")
    with pytest.raises(InvalidRequestError, match="kv_load_failure_policy"):
        KVTransferConfig("SharedStorageConnector", kv_load_failure_policy="ignore")
    with pytest.raises(InvalidRequestError, match="kv_transfer_config"):
        make_engine(folder, kv_transfer_config={"kv_connector": "SharedStorageConnector",
                                                "bogus": 1})


FLAKY = """
from loom.kv_connector.store_connector import SharedStorageConnector


class FlakyConnector(SharedStorageConnector):
    '''Raises from start_load_kv the first time it has blocks to load.'''

    raised = False

    def start_load_kv(self, **kwargs):
        if self._metadata is not None and self._metadata.loads and not FlakyConnector.raised:
            FlakyConnector.raised = True
            raise RuntimeError("store unreachable")
        super().start_load_kv(**kwargs)
"""


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_connector_that_raises_while_loading_never_stops_the_engine(
    tiny_models, tmp_path, monkeypatch, policy
):
    """A user's connector whose start_load_kv raises: under "recompute" the request computes
    every block it was to load and equals transformers; under "fail" only that request fails,
    naming the cause. Either way no exception escapes, nothing stays loading, and the same
    engine serves the next requests."""
    folder, hf = tiny_models["gemma3"]
    produce(folder, tmp_path / "store")
    (tmp_path / "flaky_connectors.py").write_text(FLAKY)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("flaky_connectors", None)
    engine = make_engine(folder, kv_transfer_config=KVTransferConfig(
        "FlakyConnector", kv_connector_module_path="flaky_connectors", kv_role="kv_consumer",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path / "store")},
        kv_load_failure_policy=policy))
    other = prompt_ids(9, 77)
    engine.add_request("c", IDS, GREEDY)
    engine.add_request("fine", other, GREEDY)
    outs = run_to_completion(engine)
    assert sys.modules["flaky_connectors"].FlakyConnector.raised
    assert outs["fine"].outputs[0].token_ids == hf_greedy(hf, other, 6)
    if policy == "recompute":
        assert outs["c"].error is None and outs["c"].outputs[0].token_ids == hf_greedy(hf, IDS, 6)
        assert engine.stats.kv_load_failed_tokens == 44 and engine.stats.kv_loaded_tokens == 0
    else:
        assert outs["c"].outputs[0].finish_reason == "error"
        assert "'c'" in outs["c"].error and "RuntimeError: store unreachable" in outs["c"].error
    assert not engine.has_unfinished_requests() and engine.kv_pool_all_free
    engine.reset_prefix_cache()  # so the next request asks the store again
    engine.add_request("after", IDS, GREEDY)  # loads now succeed
    assert run_to_completion(engine)["after"].outputs[0].token_ids == hf_greedy(hf, IDS, 6)
    assert engine.stats.kv_loaded_tokens == 44 and engine.kv_pool_all_free
    sys.modules.pop("flaky_connectors", None)
