"""A user's KV connector that raises stays a fault of the request(s) it concerns.

The connector is what a user would write: a subclass of `SharedStorageConnector` in a
module of their own, loaded through `kv_connector_module_path`. It raises `RuntimeError`
once, in the method a test names, at the first call where that method has work for a
request (a load, a save, a match). Whatever the method and the policy:

- no exception escapes `LLMEngine.step`, `LLM.generate` or `AsyncLLMEngine.generate`;
- the request it concerns completes with the tokens of an engine without a connector
  ("recompute", or a fault where nothing needs recomputing) or ends with
  finish_reason="error" and an error naming it and the fault ("fail");
- a bystander request (nothing in the store) is never affected;
- the same engine then serves a request that loads from the store, with the same tokens,
  and the KV pool ends fully free.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import sys
from pathlib import Path

import pytest
from engine.helpers import make_engine, prompt_ids, run_to_completion

from loom import LLM, SamplingParams
from loom.engine.async_engine import AsyncLLMEngine
from loom.kv_connector import KVTransferConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
FIRST = prompt_ids(45, 3)  # 11 full blocks of 4 in the store before the last token
SECOND = prompt_ids(41, 50)  # 10 full blocks in the store
BYSTANDER = prompt_ids(13, 90)  # nothing of it in the store
MODULE = "faulty_connectors"

FAULTY = '''
from pathlib import Path

from loom.kv_connector.store_connector import SharedStorageConnector


class FaultyConnector(SharedStorageConnector):
    """Raises once, from the method named by extra config "raise_in", at its first call
    with work to do; the file "marker" records that it did (both halves see it)."""

    def _fault(self, method, has_work=True):
        extra = self.config.kv_connector_extra_config
        marker = Path(extra["marker"])
        if extra["raise_in"] == method and has_work and not marker.exists():
            marker.write_text(method)
            raise RuntimeError(f"injected fault in {method}")

    # ---- scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self._fault("get_num_new_matched_tokens")
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._fault("update_state_after_alloc")
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def get_computed_token_gaps(self, request):
        self._fault("get_computed_token_gaps")
        return super().get_computed_token_gaps(request)

    def build_connector_meta(self, scheduler_output):
        self._fault("build_connector_meta", bool(scheduler_output.loading_request_ids))
        return super().build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        self._fault("request_finished")
        return super().request_finished(request, block_ids)

    # ---- worker side
    def start_load_kv(self, **kwargs):
        self._fault("start_load_kv", self._metadata is not None and bool(self._metadata.loads))
        super().start_load_kv(**kwargs)

    def wait_for_save(self):
        self._fault("wait_for_save", self._metadata is not None and bool(self._metadata.saves))
        super().wait_for_save()
'''

# Method -> whether the request it concerns fails under kv_load_failure_policy="fail" (else
# it completes under either policy: nothing of its K/V was lost).
FAILS_UNDER_FAIL = {
    "start_load_kv": True,
    "wait_for_save": False,
    "get_num_new_matched_tokens": False,
    "update_state_after_alloc": True,
    "get_computed_token_gaps": True,
    "build_connector_meta": True,
    "request_finished": False,
}
CASES = [(m, p) for m, fails in FAILS_UNDER_FAIL.items()
         for p in (["recompute", "fail"] if fails else ["recompute"])]


@pytest.fixture(scope="module")
def plain_tokens(tiny_models) -> dict[str, list[int]]:
    """Greedy tokens of an engine without a connector, by prompt name."""
    engine = make_engine(tiny_models["gemma3"][0])
    prompts = {"first": FIRST, "second": SECOND, "bystander": BYSTANDER}
    for name, ids in prompts.items():
        engine.add_request(name, ids, GREEDY)
    outs = run_to_completion(engine)
    return {name: outs[name].outputs[0].token_ids for name in prompts}


@pytest.fixture(scope="module")
def filled_store(tiny_models, tmp_path_factory) -> Path:
    """A store holding FIRST's and SECOND's blocks, saved by a plain producer engine."""
    store = tmp_path_factory.mktemp("store")
    producer = make_engine(tiny_models["gemma3"][0], kv_transfer_config=KVTransferConfig(
        "SharedStorageConnector", kv_role="kv_producer",
        kv_connector_extra_config={"shared_storage_path": str(store)}))
    producer.add_request("first", FIRST, SamplingParams(max_tokens=1))
    producer.add_request("second", SECOND, SamplingParams(max_tokens=1))
    run_to_completion(producer)
    assert len(list(store.rglob("*.safetensors"))) == 21
    return store


@pytest.fixture
def faulty(filled_store, tmp_path, monkeypatch):
    """fn(method, policy) -> (a KVTransferConfig for FaultyConnector raising once in
    `method`, over a copy of the filled store; the marker file it writes when it raised)."""
    (tmp_path / f"{MODULE}.py").write_text(FAULTY)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(MODULE, None)
    store = tmp_path / "store"
    shutil.copytree(filled_store, store)
    marker = tmp_path / "raised"

    def config(method: str, policy: str) -> tuple[KVTransferConfig, Path]:
        return KVTransferConfig(
            "FaultyConnector", kv_connector_module_path=MODULE, kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": str(store), "raise_in": method,
                                       "marker": str(marker)},
            kv_load_failure_policy=policy,
        ), marker

    yield config
    sys.modules.pop(MODULE, None)


def check_first(out, method: str, policy: str, tokens: list[int]) -> None:
    """The faulted request: an error naming it and the fault, or the plain tokens."""
    if policy == "fail" and FAILS_UNDER_FAIL[method]:
        assert out.finished and out.outputs[0].finish_reason == "error"
        assert f"'{out.request_id}'" in out.error
        assert f"RuntimeError: injected fault in {method}" in out.error
    else:
        assert out.error is None, out.error
        assert out.outputs[0].token_ids == tokens


@pytest.mark.parametrize(("method", "policy"), CASES)
def test_a_fault_stays_with_its_request_and_the_engine_goes_on(
    tiny_models, plain_tokens, faulty, caplog, method, policy
):
    config, marker = faulty(method, policy)
    engine = make_engine(tiny_models["gemma3"][0], kv_transfer_config=config)
    engine.add_request("first", FIRST, GREEDY)
    engine.add_request("bystander", BYSTANDER, GREEDY)
    with caplog.at_level(logging.WARNING, logger="loom"):
        outs = run_to_completion(engine)  # nothing raises out of step()
    assert marker.read_text() == method
    check_first(outs["first"], method, policy, plain_tokens["first"])
    assert outs["bystander"].error is None
    assert outs["bystander"].outputs[0].token_ids == plain_tokens["bystander"]
    faults = [r for r in caplog.records if f"injected fault in {method}" in r.getMessage()]
    assert len(faults) == 1  # logged once, with the exception
    if method == "get_num_new_matched_tokens":
        assert "'first'" in faults[0].getMessage()
        assert engine.stats.kv_loaded_tokens == 0  # no external hit: it computed everything
    assert not engine.has_unfinished_requests() and engine.kv_pool_all_free
    # The same engine, its connector healthy again: SECOND loads all 40 stored tokens.
    loaded = engine.stats.kv_loaded_tokens
    engine.add_request("second", SECOND, GREEDY)
    out = run_to_completion(engine)["second"]
    assert out.error is None and out.outputs[0].token_ids == plain_tokens["second"]
    assert engine.stats.kv_loaded_tokens - loaded == 40
    assert not engine.has_unfinished_requests() and engine.kv_pool_all_free


@pytest.mark.parametrize(("method", "policy"), [
    ("start_load_kv", "fail"), ("get_num_new_matched_tokens", "recompute"),
    ("update_state_after_alloc", "recompute"), ("build_connector_meta", "fail"),
])
def test_llm_generate_never_raises_a_connector_fault(
    tiny_models, plain_tokens, faulty, method, policy
):
    config, marker = faulty(method, policy)
    llm = LLM(model=str(tiny_models["gemma3"][0]), dtype="float32", device="cpu",
              num_kv_blocks=256, block_size=4, kv_transfer_config=config)
    first, bystander = llm.generate([FIRST, BYSTANDER], GREEDY)
    assert marker.read_text() == method
    check_first(first, method, policy, plain_tokens["first"])
    assert bystander.error is None
    assert bystander.outputs[0].token_ids == plain_tokens["bystander"]
    (second,) = llm.generate([SECOND], GREEDY)
    assert second.error is None and second.outputs[0].token_ids == plain_tokens["second"]
    assert llm.engine.kv_pool_all_free


@pytest.mark.parametrize(("method", "policy"), [
    ("start_load_kv", "recompute"), ("start_load_kv", "fail"),
    ("get_num_new_matched_tokens", "recompute"), ("update_state_after_alloc", "fail"),
])
def test_async_generate_never_raises_a_connector_fault(
    tiny_models, plain_tokens, faulty, method, policy
):
    config, marker = faulty(method, policy)
    engine = AsyncLLMEngine(make_engine(tiny_models["gemma3"][0], kv_transfer_config=config))

    async def last_output(prompt):
        last = None
        async for out in engine.generate(prompt, GREEDY):
            last = out
        return last

    async def main():
        first, bystander = await asyncio.gather(last_output(FIRST), last_output(BYSTANDER))
        second = await last_output(SECOND)
        return first, bystander, second

    first, bystander, second = asyncio.run(main())
    assert marker.read_text() == method
    check_first(first, method, policy, plain_tokens["first"])
    assert bystander.error is None
    assert bystander.outputs[0].token_ids == plain_tokens["bystander"]
    assert second.error is None and second.outputs[0].token_ids == plain_tokens["second"]
    assert engine.engine.kv_pool_all_free
