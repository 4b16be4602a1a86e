"""The decode-graph path (static buffers, padded buckets, the pad block, fixed attention plans)
and the Triton attention backend, end to end on tiny models.

Without CUDA the Triton kernels run in Triton's interpreter and the graph runner calls its
forward eagerly over the same static buffers instead of replaying a captured graph, so all
of the path but the capture is exercised; with CUDA the same tests capture real graphs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.helpers import make_engine, prompt_ids, run_to_completion
from tiny_reference import hf_last_logits

from loom import SamplingParams
from loom.runner.decode_graphs import graph_batch_sizes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
LOGPROBS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)


def test_graph_batch_sizes():
    assert graph_batch_sizes(64) == [1, 2, 4, *range(8, 65, 8)]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(16, [8, 2, 2, 99]) == [2, 8]
    with pytest.raises(ValueError, match="no size"):
        graph_batch_sizes(4, [8])


def _poison(engine):
    """Fill the KV pool with NaN where the backend leaves it unwritten (not zeroed), so any
    read of a slot no step wrote would now spoil the outputs, not only by chance. A backend
    that reads unwritten slots (the torch reference on CUDA gathers whole blocks and masks
    them) is given a zeroed pool, and its pool stays as given."""
    runner = engine.runner
    if runner.backend.reads_only_written_slots(runner.dtype, runner.kv_cache_dtype):
        for cache in runner.kv_caches:
            cache.fill_(float("nan"))


def _generate(folder, prompts, **kwargs):
    """(engine, per prompt: [(token, its logprob)]) of greedy generation."""
    engine = make_engine(folder, device=DEVICE, max_num_seqs=8, max_model_len=64, **kwargs)
    _poison(engine)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, LOGPROBS)
    outs = run_to_completion(engine)
    assert engine.kv_pool_all_free
    results = []
    for i in range(len(prompts)):
        out = outs[f"r{i}"].outputs[0]
        results.append([(t, lp[t]) for t, lp in zip(out.token_ids, out.logprobs, strict=True)])
    return engine, results


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_graph_decode_equals_eager_and_transformers(tiny_models, arch):
    folder, hf = tiny_models[arch]
    # Three sequences of different lengths: decode steps of 3 run in the bucket of 4, with a
    # padding row writing into the pad block while the real rows read their own blocks.
    prompts = [prompt_ids(9), prompt_ids(14, 3), prompt_ids(5, 7)]
    graphs, got = _generate(folder, prompts, attention_backend="triton",
                            cuda_graph_sizes=[1, 2, 4])
    runner = graphs.runner.decode_graphs
    assert runner is not None and runner.sizes == [1, 2, 4]
    assert runner.steps_run > 0  # the graph path ran (decode steps of 3, then fewer)
    _, eager = _generate(folder, prompts, attention_backend="triton", enforce_eager=True)
    _, reference = _generate(folder, prompts, attention_backend="torch")
    for rows in (eager, reference):
        for a, b in zip(got, rows, strict=True):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=1e-5)
    for prompt, generated in zip(prompts, got, strict=True):
        seq = list(prompt)
        for t, lp in generated:
            want = hf_last_logits(hf, seq).log_softmax(-1)
            assert t == int(want.argmax())
            assert lp == pytest.approx(float(want[t]), abs=1e-4)
            seq.append(t)


def test_a_batch_larger_than_every_bucket_runs_eagerly(tiny_models):
    """Three decoding sequences with buckets of 1 and 2: their steps of three run eagerly,
    the later steps of two or one from the graphs, and the tokens are the eager run's."""
    folder, _ = tiny_models["gemma3"]
    prompts = [prompt_ids(9), prompt_ids(14, 3), prompt_ids(5, 7)]
    engine, got = _generate(folder, prompts, attention_backend="triton",
                            cuda_graph_sizes=[1, 2])
    runner = engine.runner.decode_graphs
    assert runner.sizes == [1, 2]
    _, eager = _generate(folder, prompts, attention_backend="triton", enforce_eager=True)
    assert [[t for t, _ in rows] for rows in got] == [[t for t, _ in rows] for rows in eager]
    assert not runner.applies([_chunk(i) for i in range(3)])
    assert runner.applies([_chunk(i) for i in range(2)])


def _chunk(i):
    from loom.core.scheduler_output import ScheduledChunk

    return ScheduledChunk(request_id=f"c{i}", token_ids=[5], start_pos=4, block_ids=[i],
                          needs_logits=True)


def test_graph_session_equals_fresh_forward(tiny_models):
    """A session alternating prefill and graph-replayed generation keeps the invariant."""
    folder, hf = tiny_models["gemma3"]
    engine = make_engine(folder, device=DEVICE, max_num_seqs=4, max_model_len=96,
                         attention_backend="triton", cuda_graph_sizes=[1, 2, 4],
                         max_num_batched_tokens=8)
    _poison(engine)
    engine.add_request("s", prompt_ids(11), GREEDY, session=True)
    engine.add_request("partner", prompt_ids(7, 2),
                       SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for k in range(3):
        while engine.get_session("s").status != "PAUSED":
            engine.step()
        view = engine.get_session("s")
        torch.testing.assert_close(engine.get_logits("s").cpu(),
                                   hf_last_logits(hf, list(view.token_ids)), atol=1e-4, rtol=0)
        engine.append("s", prompt_ids(6 + k, 20 + k))
        while engine.get_session("s").status != "PAUSED":
            engine.step()
        engine.resume("s", GREEDY)
    assert engine.runner.decode_graphs.steps_run > 0
    assert engine.num_recomputed_tokens == 0
    engine.close("s")
    run_to_completion(engine)
    assert engine.kv_pool_all_free


def test_speculative_verification_through_triton_equals_transformers(tiny_models):
    """n-gram drafts on the Triton backend: verification steps (up to k + 1 tokens a
    sequence, padded to k + 1 slots) replay their own graphs, plain decode steps theirs;
    greedy tokens equal transformers', and tokens and logprobs equal the eager path's."""
    from tiny_reference import hf_greedy

    folder, hf = tiny_models["gemma3"]
    cycle = prompt_ids(5, 4)
    prompts = [[cycle[i % 5] for i in range(20)], prompt_ids(13, 9), prompt_ids(6, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    results = []
    for eager in (False, True):
        engine = make_engine(folder, device=DEVICE, max_num_seqs=4, max_model_len=96,
                             attention_backend="triton", cuda_graph_sizes=[1, 2, 4],
                             speculative_config=spec, enforce_eager=eager)
        _poison(engine)
        for i, p in enumerate(prompts):
            engine.add_request(f"s{i}", p, params)
        outs = run_to_completion(engine)
        results.append([outs[f"s{i}"].outputs[0] for i in range(len(prompts))])
        assert engine.speculator.num_accepted > 0
        assert engine.kv_pool_all_free
        if not eager:
            verify = engine.runner.verify_graphs
            assert verify is not None and verify.tokens_per_seq == 4 and verify.steps_run > 0
    for p, graph, eager in zip(prompts, *results, strict=True):
        assert list(graph.token_ids) == list(eager.token_ids) == hf_greedy(hf, p, 12)
        graph_lps = [lp[t] for t, lp in zip(graph.token_ids, graph.logprobs, strict=True)]
        eager_lps = [lp[t] for t, lp in zip(eager.token_ids, eager.logprobs, strict=True)]
        assert graph_lps == pytest.approx(eager_lps, abs=1e-5)
