"""LLMEngine and LLM on tiny random models: equal to transformers under chunking and preemption."""

from __future__ import annotations

import json

import pytest
import torch
from engine.helpers import make_engine, prompt_ids, run_to_completion
from tiny_reference import TINY_ARCHS, hf_greedy, hf_last_logits

from loom import LLM, SamplingParams
from loom.errors import (
    DuplicateRequestError,
    InvalidSamplingParamsError,
    ModelNotFoundError,
    PromptTooLongError,
    UnknownRequestError,
    UnsupportedModelError,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
PROMPT_LENGTHS = [5, 23, 1, 40, 12]


def _generate(engine, prompts, params=GREEDY):
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    outs = run_to_completion(engine)
    return [outs[str(i)].outputs[0].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize(
    "limits",
    [
        dict(),  # roomy
        dict(max_num_batched_tokens=7),  # forces chunked prefill next to decodes
        dict(num_kv_blocks=24, max_num_batched_tokens=16),  # forces preemption
    ],
    ids=["roomy", "chunked", "preempted"],
)
def test_batched_greedy_equals_transformers(tiny_models, arch, limits):
    folder, hf = tiny_models[arch]
    prompts = [prompt_ids(n, offset=i) for i, n in enumerate(PROMPT_LENGTHS)]
    engine = make_engine(folder, **limits)
    got = _generate(engine, prompts)
    for ids, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(hf, ids, 32)
    if "num_kv_blocks" in limits:
        assert engine.scheduler.num_preemptions > 0
        assert engine.num_recomputed_tokens > 0
    assert engine.kv_pool_all_free


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_first_sampled_token_logprobs_match_transformers(tiny_models, arch):
    """The logprobs of the first sampled token (and the top 3) at the end of the prompt.

    Loom has no `prompt_logprobs`: this is the one position whose logprobs it reports.
    """
    folder, hf = tiny_models[arch]
    engine = make_engine(folder)
    ids = prompt_ids(17)
    engine.add_request("a", ids, SamplingParams(temperature=0.0, max_tokens=1, logprobs=3))
    out = run_to_completion(engine)["a"].outputs[0]
    ref = torch.log_softmax(hf_last_logits(hf, ids), dim=-1)
    (position,) = out.logprobs
    token = out.token_ids[0]
    assert token == int(ref.argmax())
    assert position[token] == pytest.approx(float(ref[token]), abs=1e-4)
    top = ref.topk(3)
    for t, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
        assert position[t] == pytest.approx(lp, abs=1e-4)


def test_llm_generate_text_api(tiny_models):
    folder, _ = tiny_models["llama"]
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=128)
    outs = llm.generate(["Once upon a time", "The capital of France is"],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert [o.prompt for o in outs] == ["Once upon a time", "The capital of France is"]
    for out in outs:
        assert out.finished and out.prompt_token_ids[0] == llm.tokenizer.bos_token_id
        completion = out.outputs[0]
        assert len(completion.token_ids) == 8 and completion.finish_reason == "length"
        assert completion.text == llm.tokenizer.decode(completion.token_ids)


def test_seeded_sampling_is_reproducible_and_independent_of_batch(tiny_models):
    folder, _ = tiny_models["qwen2"]
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12,
                            ignore_eos=True)
    alone = _generate(make_engine(folder), [prompt_ids(9)], params)[0]
    engine = make_engine(folder)
    engine.add_request("other", prompt_ids(30, 3), SamplingParams(temperature=1.0, max_tokens=20))
    together = _generate(engine, [prompt_ids(9)], params)[0]
    assert alone == together


def test_n_greater_than_one_gives_n_outputs(tiny_models):
    folder, _ = tiny_models["llama"]
    engine = make_engine(folder)
    engine.add_request("x", prompt_ids(6), SamplingParams(n=3, temperature=1.0, seed=7,
                                                         max_tokens=5, ignore_eos=True))
    out = run_to_completion(engine)["x"]
    assert out.finished and [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 5 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert engine.kv_pool_all_free


def test_stop_token_ids_min_tokens_and_stop_strings(tiny_models):
    folder, hf = tiny_models["gemma3"]
    ids = prompt_ids(10)
    reference = hf_greedy(hf, ids, 12)
    engine = make_engine(folder)
    stop_token = reference[4]
    first_at = reference.index(stop_token)
    engine.add_request("s", ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[stop_token]))
    out = run_to_completion(engine)["s"].outputs[0]
    assert out.token_ids == reference[: first_at + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token

    engine.add_request("m", ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[reference[0]], min_tokens=3))
    out = run_to_completion(engine)["m"].outputs[0]
    assert len(out.token_ids) >= 3 and reference[0] not in out.token_ids[:3]

    full_text = engine.tokenizer.decode(reference)
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 2]
    if stop.strip():
        engine.add_request("t", ids, SamplingParams(temperature=0.0, max_tokens=12,
                                                    ignore_eos=True, stop=[stop]))
        out = run_to_completion(engine)["t"].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == full_text[: full_text.index(stop)]
    assert engine.kv_pool_all_free


def test_bad_input_raises_clear_errors_and_loses_nothing(tiny_models, tmp_path):
    folder, hf = tiny_models["llama"]
    engine = make_engine(folder, max_model_len=64)
    engine.add_request("ok", prompt_ids(8), GREEDY)
    with pytest.raises(DuplicateRequestError, match="ok"):
        engine.add_request("ok", prompt_ids(8), GREEDY)
    with pytest.raises(PromptTooLongError, match="max_model_len=64"):
        engine.add_request("long", prompt_ids(100), GREEDY)
    with pytest.raises(UnknownRequestError, match="nope"):
        engine.abort_request("nope")
    with pytest.raises(InvalidSamplingParamsError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(InvalidSamplingParamsError, match="temperature"):
        SamplingParams(temperature=-1)
    outs = run_to_completion(engine)
    assert outs["ok"].outputs[0].token_ids == hf_greedy(hf, prompt_ids(8), 32)
    assert engine.kv_pool_all_free
    with pytest.raises(ModelNotFoundError):
        make_engine(tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        make_engine(bad)


def test_llm_generate_reports_too_long_prompt_and_runs_the_rest(tiny_models):
    folder, _ = tiny_models["qwen3"]
    llm = LLM(model=str(folder), dtype="float32", max_model_len=32, num_kv_blocks=64)
    outs = llm.generate([prompt_ids(5), prompt_ids(50)], GREEDY.with_updates(max_tokens=4))
    assert outs[0].outputs[0].finish_reason == "length" and len(outs[0].outputs[0].token_ids) == 4
    assert outs[1].outputs[0].finish_reason == "error" and "max_model_len" in outs[1].error


def test_abort_mid_generation_frees_blocks(tiny_models):
    folder, _ = tiny_models["qwen2"]
    engine = make_engine(folder)
    engine.add_request("a", prompt_ids(20), GREEDY)
    engine.add_request("b", prompt_ids(20, 1), GREEDY)
    engine.step()
    engine.step()
    engine.abort_request("a")
    with pytest.raises(UnknownRequestError, match="aborted"):
        engine.abort_request("a")
    outs = run_to_completion(engine)
    assert "b" in outs and outs["b"].finished
    assert engine.kv_pool_all_free
