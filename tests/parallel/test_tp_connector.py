"""The KV connector under tensor parallelism: every rank saves and loads its own KV heads under
its own keys, and whatever a rank cannot load is computed, so the output equals one device's.

One tensor-parallel engine lives at a time (torch.distributed has one default group per
process): the module's producer is shut down before any test starts, and every test shuts its
engine down before it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from engine.helpers import make_engine, prompt_ids, run_to_completion

from loom import SamplingParams
from loom.kv_connector import KVCacheSpec, KVTransferConfig

ARCH = "gemma3"
IDS = prompt_ids(45, 3)  # 11 full blocks of 4 before the last token
STORED_BLOCKS = 11
STORED_TOKENS = STORED_BLOCKS * 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
PREFILL = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
ATOL = 1e-5  # float32, a sum split over two ranks: rounding only
ENGINE = dict(num_kv_blocks=32, block_size=4)


def shared(path: Path, role: str, policy: str = "recompute") -> KVTransferConfig:
    return KVTransferConfig("SharedStorageConnector", kv_role=role,
                            kv_connector_extra_config={"shared_storage_path": str(path)},
                            kv_load_failure_policy=policy)


@contextlib.contextmanager
def engine_on(folder: Path, **kwargs) -> Iterator:
    """An engine that is shut down (its worker ranks stopped) however the test ends."""
    engine = make_engine(folder, **ENGINE, **kwargs)
    try:
        yield engine
    finally:
        engine.shutdown()


@dataclass
class Run:
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    error: str | None


def generate(engine, rid: str = "c", poison: bool = False) -> Run:
    """Greedy tokens and top-2 logprobs of IDS; `poison` first fills rank 0's KV pool with
    large noise, so any position it neither loads nor computes changes the output."""
    if poison:
        generator = torch.Generator().manual_seed(0)
        for cache in engine.runner.kv_caches:
            cache.copy_(torch.randn(cache.shape, generator=generator) * 100)
    engine.add_request(rid, IDS, GREEDY)
    out = run_to_completion(engine)[rid]
    completion = out.outputs[0]
    return Run(list(completion.token_ids), list(completion.logprobs or []), out.error)


def assert_same_run(run: Run, reference: Run) -> None:
    assert run.error is None
    assert run.token_ids == reference.token_ids
    assert len(run.logprobs) == len(reference.logprobs) == len(reference.token_ids)
    for got, want in zip(run.logprobs, reference.logprobs, strict=True):
        assert got.keys() == want.keys()
        torch.testing.assert_close(torch.tensor([got[t] for t in want]),
                                   torch.tensor(list(want.values())), atol=ATOL, rtol=0)


def rank_spec(spec: KVCacheSpec, rank: int) -> KVCacheSpec:
    return dataclasses.replace(spec, tensor_parallel_rank=rank)


@pytest.fixture(scope="module")
def folder(tiny_models) -> Path:
    return tiny_models[ARCH][0]


@pytest.fixture(scope="module")
def reference(folder) -> Run:
    """One device, no connector: what every run below must produce."""
    engine = make_engine(folder, **ENGINE)
    return generate(engine, "ref")


@dataclass
class Produced:
    store: Path
    spec: KVCacheSpec  # rank 0's (the driver's)
    saved_blocks: int


@pytest.fixture(scope="module")
def produced(folder, tmp_path_factory) -> Produced:
    """A store a TP=2 producer filled with IDS's blocks; the producer is shut down."""
    store = tmp_path_factory.mktemp("tp2-store")
    with engine_on(folder, tensor_parallel_size=2,
                   kv_transfer_config=shared(store, "kv_producer")) as engine:
        engine.add_request("p", IDS, PREFILL)
        run_to_completion(engine)
        assert engine.kv_pool_all_free
        return Produced(store, engine.config.kv_cache_spec, engine.stats.kv_saved_blocks)


def copy_of(store: Path, tmp_path: Path) -> Path:
    target = tmp_path / "store"
    shutil.copytree(store, target)
    return target


def test_each_rank_saves_its_own_heads_under_its_own_keys(produced) -> None:
    spec = produced.spec
    assert (spec.tensor_parallel_size, spec.tensor_parallel_rank) == (2, 0)
    assert spec.num_kv_heads == 1  # the tiny models' 2 KV heads, split over 2 ranks
    assert produced.saved_blocks == STORED_BLOCKS  # rank 0's counter
    folders = {p.name: sorted(f.name for f in p.glob("*.safetensors"))
               for p in produced.store.iterdir() if p.is_dir()}
    prefixes = [rank_spec(spec, r).fingerprint for r in range(2)]
    assert len(set(prefixes)) == 2
    assert sorted(folders) == sorted(prefixes)
    assert len(folders[prefixes[0]]) == STORED_BLOCKS
    assert folders[prefixes[0]] == folders[prefixes[1]]  # the same blocks, by hash
    one_device = dataclasses.replace(spec, tensor_parallel_size=1, num_kv_heads=2)
    assert one_device.fingerprint not in folders
    for name in folders[prefixes[0]]:  # each rank wrote its own KV heads
        rank0 = (produced.store / prefixes[0] / name).read_bytes()
        assert rank0 != (produced.store / prefixes[1] / name).read_bytes()


def test_a_tp2_consumer_loads_every_ranks_blocks_and_equals_one_device(
    folder, produced, reference
) -> None:
    with engine_on(folder, tensor_parallel_size=2,
                   kv_transfer_config=shared(produced.store, "kv_consumer")) as engine:
        run = generate(engine, poison=True)
        stats = engine.stats
        assert (stats.kv_loaded_tokens, stats.kv_gap_tokens, stats.kv_load_failed_tokens) == (
            STORED_TOKENS, 0, 0)
        assert stats.num_recomputed_tokens == 0 and engine.kv_pool_all_free
    assert_same_run(run, reference)


def test_a_tp1_engine_loads_nothing_a_tp2_engine_wrote(folder, produced, reference) -> None:
    with engine_on(folder, kv_transfer_config=shared(produced.store, "kv_consumer")) as engine:
        run = generate(engine, poison=True)
        stats = engine.stats
        assert (stats.kv_loaded_tokens, stats.kv_gap_tokens, stats.kv_load_failed_tokens) == (
            0, 0, 0)
        assert engine.kv_pool_all_free
    assert_same_run(run, reference)


def test_a_tp2_engine_loads_nothing_a_tp1_engine_wrote(folder, tmp_path, reference) -> None:
    store = tmp_path / "tp1-store"
    with engine_on(folder, kv_transfer_config=shared(store, "kv_producer")) as engine:
        engine.add_request("p", IDS, PREFILL)
        run_to_completion(engine)
        assert engine.stats.kv_saved_blocks == STORED_BLOCKS
    with engine_on(folder, tensor_parallel_size=2,
                   kv_transfer_config=shared(store, "kv_consumer")) as engine:
        run = generate(engine, poison=True)
        stats = engine.stats
        assert (stats.kv_loaded_tokens, stats.kv_load_failed_tokens) == (0, 0)
        assert engine.kv_pool_all_free
    assert_same_run(run, reference)


@pytest.mark.parametrize("lost", ["all", "one"])
def test_blocks_rank1_lost_are_not_matched_and_are_computed_on_every_rank(
    folder, produced, reference, tmp_path, lost
) -> None:
    """The scheduler half counts a block as stored only when every rank's entry is there:
    a block rank 1 lost is a gap (computed on both ranks), never a load that fails."""
    store = copy_of(produced.store, tmp_path)
    rank1 = store / rank_spec(produced.spec, 1).fingerprint
    if lost == "all":
        shutil.rmtree(rank1)
        loaded = 0
    else:
        sorted(rank1.glob("*.safetensors"))[0].unlink()
        loaded = STORED_TOKENS - 4
    with engine_on(folder, tensor_parallel_size=2,
                   kv_transfer_config=shared(store, "kv_consumer", "fail")) as engine:
        run = generate(engine, poison=True)
        stats = engine.stats
        assert (stats.kv_loaded_tokens, stats.kv_load_failed_tokens) == (loaded, 0)
        assert stats.kv_gap_tokens in (0, 4)  # 4: the lost block lay inside the match
        assert engine.kv_pool_all_free
    assert_same_run(run, reference)


def test_a_block_rank1_cannot_read_under_fail_fails_the_request_naming_rank1s_key(
    folder, produced, tmp_path
) -> None:
    """Rank 1's entry is there but damaged: rank 1's load fails, the driver gathers it, and
    policy "fail" fails the request with rank 1's key in the error."""
    store = copy_of(produced.store, tmp_path)
    rank1_prefix = rank_spec(produced.spec, 1).fingerprint
    victim = sorted((store / rank1_prefix).glob("*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    with engine_on(folder, tensor_parallel_size=2,
                   kv_transfer_config=shared(store, "kv_consumer", "fail")) as engine:
        engine.add_request("bad", IDS, GREEDY)
        out = run_to_completion(engine)["bad"]
        assert out.outputs[0].finish_reason == "error"
        assert f"{rank1_prefix}/{victim.stem}" in out.error
        assert engine.kv_pool_all_free


RANK1_RAISES = '''
from loom.kv_connector.store_connector import SharedStorageConnector


class Rank1RaisesConnector(SharedStorageConnector):
    """A user's connector whose load raises on rank 1 only (rank 0 loads fine)."""

    def start_load_kv(self, **kwargs):
        if self.spec.tensor_parallel_rank == 1 and self._metadata and self._metadata.loads:
            raise RuntimeError("rank 1's store is unreachable")
        super().start_load_kv(**kwargs)
'''


def test_a_connector_that_raises_on_rank1_recomputes_on_every_rank(
    folder, produced, reference, tmp_path, monkeypatch
) -> None:
    (tmp_path / "rank1_raises.py").write_text(RANK1_RAISES)
    monkeypatch.syspath_prepend(str(tmp_path))  # the driver's import
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the worker's (a fresh interpreter)
    config = KVTransferConfig(
        "Rank1RaisesConnector", kv_connector_module_path="rank1_raises", kv_role="kv_consumer",
        kv_connector_extra_config={"shared_storage_path": str(produced.store)})
    with engine_on(folder, tensor_parallel_size=2, kv_transfer_config=config) as engine:
        run = generate(engine, poison=True)
        stats = engine.stats
        assert engine.kv_pool_all_free
    assert_same_run(run, reference)
    assert (stats.kv_loaded_tokens, stats.kv_load_failed_tokens) == (0, STORED_TOKENS)
