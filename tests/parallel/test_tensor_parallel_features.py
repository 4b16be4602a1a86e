"""Tensor parallelism on a CPU, every feature that touches KV: preemption, forks, drafts,
int8 shards, a rank that dies, a model that does not split.

Each test starts its own two ranks and shuts them down (one tensor-parallel engine lives at
a time in a process).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from engine.helpers import make_engine, prompt_ids, run_to_completion, session_logits
from engine.test_hooks import Script, child_plan, params, parent_plan
from processes import alive
from tiny_reference import hf_greedy, hf_last_logits

from loom import SamplingParams
from loom.engine.promise_sync import SpecialKwargs
from loom.errors import UnsupportedModelError
from loom.models.config import ModelConfig
from loom.models.tensor_parallel import check_shardable

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_preemption_on_a_small_pool(tiny_models):
    """Six requests on a pool that holds about two: they preempt each other and recompute,
    and every one gets TP=1's greedy tokens."""
    folder, _ = tiny_models["qwen2"]
    prompts = [prompt_ids(10 + i, offset=7 * i) for i in range(6)]
    want = {}
    one = make_engine(folder)
    for i, p in enumerate(prompts):
        one.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12,
                                                   ignore_eos=True))
    want = {k: list(v.outputs[0].token_ids) for k, v in run_to_completion(one).items()}
    two = make_engine(folder, tensor_parallel_size=2, num_kv_blocks=14, max_num_seqs=6)
    try:
        for i, p in enumerate(prompts):
            two.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12,
                                                       ignore_eos=True))
        got = {k: list(v.outputs[0].token_ids) for k, v in run_to_completion(two).items()}
        assert two.stats.num_preemptions > 0
        assert got == want
        assert two.kv_pool_all_free
    finally:
        two.shutdown()


def test_promise_sync_and_ngram_drafts(tiny_models):
    """A <promise>/<sync> tree (children share the parent's KV, the join prefills only the
    merged text) and n-gram speculative decoding on TP=2 equal transformers and TP=1."""
    folder, hf = tiny_models["gemma3"]
    special = SpecialKwargs(promise_token_id=10, sync_token_id=11)
    two = make_engine(folder, tensor_parallel_size=2, special_kwargs=special,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        script = Script(parent_plan, child_plan)
        prompt = prompt_ids(9)
        two.add_request("t", prompt, params(script), session=True)
        out = run_to_completion(two)["t"]
        assert len(out.children) == 2 and all(c.finished for c in out.children)
        ids = list(two.get_session("t").token_ids)
        torch.testing.assert_close(two.get_logits("t"), hf_last_logits(hf, ids), atol=1e-4,
                                   rtol=0)
        two.close("t")
        # A repetitive prompt gives the n-gram proposer matches to draft from.
        repeated = prompt_ids(6) * 4
        two.add_request("d", repeated, SamplingParams(temperature=0.0, max_tokens=16,
                                                      ignore_eos=True))
        drafted = run_to_completion(two)["d"]
        assert two.stats.num_draft_tokens > 0
        assert list(drafted.outputs[0].token_ids) == hf_greedy(hf, repeated, 16)
        assert two.kv_pool_all_free
    finally:
        two.shutdown()


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_int8_shards_are_quantised_per_shard_and_w8a8_is_batch_invariant(tiny_models,
                                                                        quantization):
    """int8 weights (and, in w8a8, activations) under TP=2: each shard has its own scales,
    so the logits differ from the float model's by quantisation noise only; and in w8a8 a
    request's logprobs are the same bits alone and batched with others (the default mode's
    invariance holds per rank, and the all-reduce of two partial sums is one addition)."""
    folder, hf = tiny_models["llama"]
    two = make_engine(folder, tensor_parallel_size=2, quantization=quantization)
    try:
        tokens = prompt_ids(11, offset=5)
        got = session_logits(two, "q", tokens)
        ref = hf_last_logits(hf, tokens)
        assert (got - ref).abs().max() < 0.05 * ref.abs().max()
        if quantization == "int8":
            return
        probe = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
        two.add_request("alone", tokens, probe)
        alone = run_to_completion(two)["alone"].outputs[0]
        for i in range(4):
            two.add_request(f"other{i}", prompt_ids(5 + 9 * i, offset=60), probe)
        two.add_request("batched", tokens, probe)
        batched = run_to_completion(two)["batched"].outputs[0]
        assert batched.token_ids == alone.token_ids
        assert batched.logprobs == alone.logprobs
    finally:
        two.shutdown()


def test_a_killed_worker_fails_the_running_requests_and_leaves_no_process(tiny_models):
    folder, _ = tiny_models["qwen3"]
    two = make_engine(folder, tensor_parallel_size=2)
    (worker,) = two.executor.workers
    try:
        two.add_request("victim", prompt_ids(8), SamplingParams(temperature=0.0,
                                                                max_tokens=200,
                                                                ignore_eos=True))
        two.step()
        two.step()
        os.kill(worker.pid, signal.SIGKILL)
        outs = {}
        for _ in range(5):
            for out in two.step():
                outs[out.request_id] = out
            if "victim" in outs and outs["victim"].finished:
                break
        victim = outs["victim"]
        assert victim.finished and victim.outputs[0].finish_reason == "error"
        assert "rank 1 died" in victim.error and "TensorParallelError" in victim.error
        assert two.kv_pool_all_free
        # The engine stays answerable: a later request fails at once with the same cause.
        two.add_request("later", prompt_ids(4), GREEDY)
        later = run_to_completion(two)["later"]
        assert later.outputs[0].finish_reason == "error" and "rank 1 died" in later.error
    finally:
        two.shutdown()
    assert worker.poll() is not None
    assert not alive(worker.pid)  # gone, not left a zombie


def test_a_model_that_does_not_split_is_refused_before_anything_starts(tiny_models):
    folder, _ = tiny_models["llama"]
    with pytest.raises(UnsupportedModelError, match="4 attention heads"):
        make_engine(folder, tensor_parallel_size=3)
    config = ModelConfig("LlamaForCausalLM", 320, 64, 2, 8, 3, 8, 512, None, (1,),
                         hf={"intermediate_size": 96})
    with pytest.raises(UnsupportedModelError, match="3 KV heads"):
        check_shardable(config, 2)
    folder, _ = tiny_models["olmoe"]  # its QK-norms need every rank's heads
    with pytest.raises(UnsupportedModelError, match="OlmoeForCausalLM does not split over"
                                                    " tensor-parallel ranks yet: its QK-norms"):
        make_engine(folder, tensor_parallel_size=2)


def test_shutdown_during_a_step_on_another_thread_ends_cleanly(tiny_models):
    """The server's case: steps run on a thread while shutdown comes from another. The
    in-flight step fails its requests, shutdown returns, and no worker is left."""
    import threading

    folder, _ = tiny_models["llama"]
    two = make_engine(folder, tensor_parallel_size=2)
    (worker,) = two.executor.workers
    two.add_request("long", prompt_ids(8), SamplingParams(temperature=0.0, max_tokens=10_000,
                                                          ignore_eos=True))
    outs, stop = [], threading.Event()

    def step_forever():
        while not stop.is_set() and two.has_unfinished_requests():
            outs.extend(two.step())

    stepper = threading.Thread(target=step_forever)
    stepper.start()
    time.sleep(1.0)
    started = time.monotonic()
    two.shutdown()
    assert time.monotonic() - started < 30
    stop.set()
    stepper.join(timeout=30)
    assert not stepper.is_alive()
    assert worker.poll() is not None
    last = [o for o in outs if o.request_id == "long"][-1]
    assert last.finished and last.outputs[0].finish_reason == "error"
