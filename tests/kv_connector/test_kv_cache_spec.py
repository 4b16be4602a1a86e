"""`KVCacheSpec` keys a store apart by everything that changes the numbers: an engine whose
spec differs from the producer's in any one such field loads nothing of what it stored (it
computes every token), while an engine with the same spec loads it all."""

from __future__ import annotations

import dataclasses

import pytest
from engine.helpers import make_engine, prompt_ids, run_to_completion

from loom import SamplingParams
from loom.core.request import Request
from loom.engine import resolve
from loom.kernels import CUDA_INVARIANT_ARITHMETIC, KERNEL_ARITHMETIC
from loom.kv_connector import (
    KVCacheSpec,
    KVConnectorRole,
    KVTransferConfig,
    SharedStorageConnector,
)

PREFILL = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
IDS = prompt_ids(45, 3)  # 11 full blocks of 4 before the last token
STORED_TOKENS = 44

# The fields that change the K/V's values, each with a value other than the producer's.
NUMERICS = {
    "dtype": "bfloat16",
    "kv_cache_dtype": "float16",
    "quantization": "w8a8",
    "large_batch_dtype": "bfloat16",
    "arithmetic": "loom-cpu-other",
}
# The weights, the block layout and who wrote it (a tensor-parallel rank stores only its own
# KV heads; tests/parallel/test_tp_connector.py checks those two fields end to end).
LAYOUT = {"model_id", "block_size", "num_layers", "num_kv_heads", "head_dim",
          "tensor_parallel_rank", "tensor_parallel_size"}


def shared(path, role):
    return KVTransferConfig("SharedStorageConnector", kv_role=role,
                            kv_connector_extra_config={"shared_storage_path": str(path)})


@pytest.fixture
def filled_store(tiny_models, tmp_path):
    """(model folder, store folder, the producer's spec) after a producer engine in the
    default settings of `make_engine` saved the blocks of IDS."""
    folder, _ = tiny_models["gemma3"]
    store = tmp_path / "store"
    producer = make_engine(folder, kv_transfer_config=shared(store, "kv_producer"))
    producer.add_request("p", IDS, PREFILL)
    run_to_completion(producer)
    assert producer.stats.kv_saved_blocks == STORED_TOKENS // 4
    return folder, store, producer.config.kv_cache_spec


def matched_tokens(store, spec: KVCacheSpec) -> int:
    """Tokens of IDS a consumer's scheduler half with `spec` finds in the store."""
    connector = SharedStorageConnector(shared(store, "kv_consumer"), spec,
                                       KVConnectorRole.SCHEDULER)
    matched, is_async = connector.get_num_new_matched_tokens(Request("c", list(IDS)), 0)
    assert not is_async
    return matched


def test_every_field_of_the_spec_is_numerics_or_layout() -> None:
    """A new field must be classified here (and so get its test below)."""
    assert {f.name for f in dataclasses.fields(KVCacheSpec)} == set(NUMERICS) | LAYOUT


def test_a_spec_equal_to_the_producers_finds_every_block(filled_store) -> None:
    _, store, spec = filled_store
    assert matched_tokens(store, dataclasses.replace(spec)) == STORED_TOKENS


@pytest.mark.parametrize("field", sorted(NUMERICS))
def test_a_spec_differing_in_one_numerics_field_finds_nothing(filled_store, field) -> None:
    _, store, spec = filled_store
    other = dataclasses.replace(spec, **{field: NUMERICS[field]})
    assert getattr(other, field) != getattr(spec, field)
    assert other.fingerprint != spec.fingerprint
    assert matched_tokens(store, other) == 0


def consume(folder, store, **kwargs):
    """A consumer engine with `make_engine`'s settings overridden by kwargs runs IDS."""
    engine = make_engine(folder, kv_transfer_config=shared(store, "kv_consumer"), **kwargs)
    engine.add_request("c", IDS, PREFILL)
    out = run_to_completion(engine)["c"]
    assert out.error is None and len(out.outputs[0].token_ids) == 1
    assert engine.kv_pool_all_free
    return engine


# Engine settings that change one numerics field of the spec (on a float32 CPU engine).
OTHER_SETTINGS = {
    "dtype": {"dtype": "bfloat16", "kv_cache_dtype": "float32"},
    "kv_cache_dtype": {"kv_cache_dtype": "float16"},
    "quantization": {"quantization": "int8"},
    "large_batch_dtype": {"prefill_dtype": "bfloat16"},
}


@pytest.mark.parametrize("field", sorted(OTHER_SETTINGS))
def test_an_engine_with_other_numerics_loads_nothing_and_computes_all(filled_store, field):
    folder, store, spec = filled_store
    engine = consume(folder, store, **OTHER_SETTINGS[field])
    other = engine.config.kv_cache_spec
    changed = {f.name for f in dataclasses.fields(KVCacheSpec)
               if getattr(other, f.name) != getattr(spec, f.name)}
    assert changed == {field}
    stats = engine.stats
    assert (stats.kv_loaded_tokens, stats.kv_gap_tokens, stats.kv_load_failed_tokens) == (0, 0, 0)


def test_an_engine_on_other_kernels_loads_nothing(filled_store, monkeypatch) -> None:
    """Where the C kernels did not load (or loaded in another arithmetic), the same mode
    gives other bits: its engine does not load blocks the producer's kernels computed."""
    folder, store, spec = filled_store
    available = spec.arithmetic.startswith(KERNEL_ARITHMETIC)
    monkeypatch.setattr(resolve, "cpu_kernels_available", lambda: not available)
    engine = consume(folder, store)
    other = "torch-cpu" if available else KERNEL_ARITHMETIC
    assert engine.config.kv_cache_spec == dataclasses.replace(spec, arithmetic=f"{other}/auto")
    assert engine.stats.kv_loaded_tokens == 0


def test_an_engine_with_the_same_settings_loads_every_stored_block(filled_store) -> None:
    folder, store, spec = filled_store
    engine = consume(folder, store)
    assert engine.config.kv_cache_spec == spec
    assert engine.stats.kv_loaded_tokens == STORED_TOKENS


def test_the_arithmetic_names_the_kernels_that_compute(monkeypatch) -> None:
    monkeypatch.setattr(resolve, "cpu_kernels_available", lambda: True)
    assert resolve.kv_arithmetic("cpu") == f"{KERNEL_ARITHMETIC}/auto"
    assert resolve.kv_arithmetic("cpu", "torch") == f"{KERNEL_ARITHMETIC}/torch"
    # CUDA: the batch-invariant kernels by default, cuBLAS's GEMMs (torch's ops) without.
    assert resolve.kv_arithmetic("cuda") == f"{CUDA_INVARIANT_ARITHMETIC}/auto"
    assert resolve.kv_arithmetic("cuda:1", "triton", False) == "torch-cuda/triton"
    monkeypatch.setattr(resolve, "cpu_kernels_available", lambda: False)
    assert resolve.kv_arithmetic("cpu") == "torch-cpu/auto"
