"""`loom serve` in the default mode: greedy answers to completions sent one at a time equal,
token for token and logprob for logprob, `LLM.generate` on the same prompts in one batch
(DESIGN.md section 5: a token's logits do not depend on what it was batched with)."""

from __future__ import annotations

import httpx
import pytest
from engine.helpers import prompt_ids
from server.conftest import run_server

from loom import LLM, SamplingParams
from loom.engine.config import EngineArgs
from loom.server.responses import completion_logprobs

MODEL = "test-model"
MAX_TOKENS = 12
TOP_LOGPROBS = 3
SHARED = prompt_ids(29, 7)
# Lengths 1-80, two sharing a prefix, two as text.
PROMPTS: list[str | list[int]] = [
    prompt_ids(1, 1), prompt_ids(9, 2), SHARED + prompt_ids(6, 3), SHARED[:17] + prompt_ids(40, 4),
    prompt_ids(80, 5), "Once upon a time there was a knight", "def add(a, b):\n    return",
]


def default_mode_args(folder, budget: int) -> EngineArgs:
    """The default mode's arithmetic (what `LLM(model="gemma3-270m")` runs on the CPU
    kernels) on a tiny float model, with a token budget per step."""
    return EngineArgs(model=str(folder), device="cpu", quantization="w8a8", dtype="float32",
                      kv_cache_dtype="float16", block_size=4, num_kv_blocks=256,
                      max_num_batched_tokens=budget)


def _first_difference(got: dict, want: dict) -> tuple[int | None, float]:
    """The first generated position whose token, logprob or top logprobs differ, and the
    largest |difference| of a logprob both report at the same position."""
    rows = list(zip(got["tokens"], got["token_logprobs"], got["top_logprobs"], strict=True))
    want_rows = list(zip(want["tokens"], want["token_logprobs"], want["top_logprobs"],
                         strict=True))
    first = next((p for p, (a, b) in enumerate(zip(rows, want_rows, strict=False)) if a != b),
                 None)
    diff = 0.0
    for (tok, lp, top), (want_tok, want_lp, want_top) in zip(rows, want_rows, strict=False):
        if tok == want_tok:
            diff = max(diff, abs(lp - want_lp))
        diff = max([diff] + [abs(top[k] - want_top[k]) for k in top.keys() & want_top.keys()])
    return first, diff


# The engine's default budget (512) batches every prompt into one prefill step; 32 chunks
# them, and one at a time each prompt is alone in its steps.
@pytest.mark.parametrize(("arch", "budget"), [
    ("gemma3", 512), ("llama", 512), ("qwen2", 512), ("qwen3", 512), ("llama", 32)])
def test_one_at_a_time_over_http_equals_one_offline_batch(tiny_models, arch, budget):
    folder, _ = tiny_models[arch]
    llm = LLM(**vars(default_mode_args(folder, budget)))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS,
                            ignore_eos=True)
    batch = [out.outputs[0] for out in llm.generate(PROMPTS, params, use_tqdm=False)]

    def decode(token_id: int) -> str:
        return llm.tokenizer.decode([token_id])

    differ = []
    with run_server(default_mode_args(folder, budget), served_model_name=MODEL) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as client:
        for i, (prompt, expected) in enumerate(zip(PROMPTS, batch, strict=True)):
            response = client.post("/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "logprobs": TOP_LOGPROBS, "ignore_eos": True})
            assert response.status_code == 200, response.text
            (choice,) = response.json()["choices"]
            want = completion_logprobs(expected, decode, TOP_LOGPROBS)
            got = choice["logprobs"]
            if choice["text"] == expected.text and got == want:
                continue
            first, diff = _first_difference(got, want)
            differ.append(
                f"prompt {i} ({len(prompt) if isinstance(prompt, list) else repr(prompt)}"
                f"{' tokens' if isinstance(prompt, list) else ''}): text "
                f"{'equal' if choice['text'] == expected.text else 'differs'}, tokens or "
                f"logprobs first differ at generated position {first}, max |diff| {diff:.3g}")
        assert server.llm_engine.kv_pool_all_free
    assert not differ, (f"{arch}, budget {budget}: the server's answers one at a time differ "
                        "from one offline batch:\n" + "\n".join(differ))
