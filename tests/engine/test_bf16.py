"""bfloat16 engines on tiny models stay within bf16 rounding of transformers.

bfloat16 is the "auto" dtype on AVX-512 BF16 CPUs and CUDA; on an AVX2-only CPU torch
emulates it, and the results must still be right. bfloat16 keeps 8 significant bits, so one
rounding is off by up to 2^-8 of the value: tolerances are counted in BF16_UNIT of the
largest reference logit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine.helpers import make_engine, prompt_ids, run_to_completion
from tiny_reference import build_tiny_model, hf_last_logits

from loom import SamplingParams

BF16_UNIT = 2.0**-8
# transformers' own bf16 forward is up to ~5 units from float32 on these models, Loom's up
# to ~3.5; 8 units leaves room for other kernels' summation orders (AVX-512 BF16, CUDA).
# A position or cache bug moves the logits by tens of units.
TOL_UNITS = 8


def bf16_tol(ref: torch.Tensor) -> float:
    """TOL_UNITS bf16 roundings of the largest reference logit."""
    return TOL_UNITS * BF16_UNIT * float(ref.abs().max())


@pytest.fixture(scope="module")
def bf16_models(tiny_models, tmp_path_factory):
    """arch -> (folder, transformers float32, transformers bfloat16). Llama and Qwen2 get q/k
    scaled by 8 so that they see token order (Gemma 3 normalises q and k: the shared one)."""
    root = tmp_path_factory.mktemp("tiny-bf16")
    folders = {"gemma3": tiny_models["gemma3"][0], "llama": root / "llama", "qwen2": root / "qwen2"}
    models = {"gemma3": tiny_models["gemma3"][1]}
    for arch in ("llama", "qwen2"):
        models[arch] = build_tiny_model(arch, folders[arch], qk_gain=8.0)
    return {
        arch: (folders[arch], hf, copy.deepcopy(hf).to(torch.bfloat16))
        for arch, hf in models.items()
    }


@pytest.mark.parametrize("arch", ["gemma3", "llama", "qwen2"])
def test_bf16_greedy_and_logprobs_follow_transformers(bf16_models, arch):
    """Chunked prefill beside decodes in bf16: every greedy token is transformers' argmax up
    to bf16 rounding, and every reported logprob is within the tolerance of float32's."""
    folder, hf, _ = bf16_models[arch]
    engine = make_engine(folder, dtype="bfloat16", max_num_batched_tokens=7)
    assert next(engine.runner.model.parameters()).dtype == torch.bfloat16
    assert engine.runner.kv_caches[0].dtype == torch.bfloat16
    prompts = [prompt_ids(5), prompt_ids(23, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    outs = run_to_completion(engine)
    for i, ids in enumerate(prompts):
        out = outs[str(i)].outputs[0]
        with torch.no_grad():  # row len(ids) - 1 + j: the logits that chose token j
            refs = hf(torch.tensor([list(ids) + list(out.token_ids)])).logits[0, len(ids) - 1 :]
        for j, (token, position) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            ref = refs[j].float()
            tol = bf16_tol(ref)
            # Loom's and float32's logits each within tol: the argmax within 2 tol.
            assert float(ref[token]) >= float(ref.max()) - 2 * tol, (i, j)
            ref_lp = torch.log_softmax(ref, dim=-1)
            for t, lp in position.items():  # (measured: within 3 units)
                assert lp == pytest.approx(float(ref_lp[t]), abs=tol), (i, j, t)
    assert engine.kv_pool_all_free


def _assert_fresh(engine, hf, hf_bf16, rid):
    """The session's stored logits equal a fresh bf16 request over its tokens and
    transformers' float32 and bf16 logits, each within bf16_tol (measured: within 5 units)."""
    view = engine.get_session(rid)
    tokens = list(view.token_ids)
    stored = engine.get_logits(rid)
    ref = hf_last_logits(hf, tokens)
    ref_bf16 = hf_last_logits(hf_bf16, tokens)
    fresh_id = f"fresh-{rid}-{len(tokens)}"
    engine.add_request(fresh_id, tokens, session=True)
    run_to_completion(engine)
    fresh = engine.get_logits(fresh_id)
    engine.close(fresh_id)
    torch.testing.assert_close(stored, fresh, atol=bf16_tol(fresh), rtol=0)
    torch.testing.assert_close(stored, ref, atol=bf16_tol(ref), rtol=0)
    torch.testing.assert_close(stored, ref_bf16, atol=bf16_tol(ref), rtol=0)


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_bf16_alternating_session_equals_fresh_forward(bf16_models, arch):
    """A bf16 session alternating chunked prefill and generation keeps last logits equal to
    a fresh bf16 request over its tokens and to transformers (float32 and bf16)."""
    folder, hf, hf_bf16 = bf16_models[arch]
    engine = make_engine(folder, dtype="bfloat16", max_num_batched_tokens=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("s", prompt_ids(11), greedy, session=True)
    engine.add_request("plain", prompt_ids(30, 5), SamplingParams(max_tokens=20, ignore_eos=True))
    for k in range(2):
        run_to_completion(engine)
        _assert_fresh(engine, hf, hf_bf16, "s")
        engine.append("s", prompt_ids(5 + 7 * k, 10 + k))  # chunked: budget is 8
        run_to_completion(engine)
        _assert_fresh(engine, hf, hf_bf16, "s")
        engine.resume("s", greedy)
    run_to_completion(engine)
    _assert_fresh(engine, hf, hf_bf16, "s")
    assert engine.num_recomputed_tokens == 0
    engine.close("s")
    assert engine.kv_pool_all_free
