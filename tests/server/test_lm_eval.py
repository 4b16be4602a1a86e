"""lm-evaluation-harness itself against `loom serve` on the real Gemma 3 270M: `lm_eval --model
local-completions` (tokenising through the server's `/tokenizer_info` and `/tokenize`, as it
does with vLLM) on a multiple-choice task from a local JSON file (`--include_path`). Its
per-choice loglikelihoods equal the sums of the engine's `prompt_logprobs` over the same
tokens bit for bit, and transformers' within float32 rounding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from server.conftest import run_server

pytest.importorskip("lm_eval")

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m"
DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " Berlin", " a banana"],
     "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " seven"], "answer": 0},
    {"question": "On a clear day the sky is", "choices": [" blue", " green", " loud"],
     "answer": 0},
]


def write_task(folder) -> None:
    data = folder / "mc.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (folder / "loom_mc.yaml").write_text(textwrap.dedent(f"""\
        task: loom_mc
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: "{{{{answer}}}}"
        target_delimiter: ""
        metric_list:
          - metric: acc
        """))


def run_lm_eval(base_url: str, tasks, out) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "OPENAI_API_KEY": "unused"}
    return subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
         f"base_url={base_url}/v1/completions,model={MODEL},num_concurrent=1,max_retries=1,"
         "tokenizer_backend=remote", "--tasks", "loom_mc", "--include_path", str(tasks),
         "--output_path", str(out), "--log_samples", "--batch_size", "1"],
        env=env, capture_output=True, text=True, timeout=600)


def scored_pairs(out) -> list[tuple[str, str, float]]:
    """(context, continuation, loglikelihood) of every request lm_eval logged."""
    files = sorted(out.rglob("samples_loom_mc_*.jsonl"))
    assert files, list(out.rglob("*"))
    pairs = []
    for line in files[-1].read_text().splitlines():
        sample = json.loads(line)
        for args, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
            pairs.append((args["arg_0"], args["arg_1"], float(resp[0][0])))
    return pairs


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm_eval's split of a causal model's request (trailing spaces go to the continuation;
    the continuation is the whole's tokens after the context's)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def test_lm_eval_scores_equal_the_engines_prompt_logprobs(gemma_engine, gemma_hf, tmp_path):
    from loom import SamplingParams

    tasks, out = tmp_path / "tasks", tmp_path / "out"
    tasks.mkdir()
    write_task(tasks)
    with run_server(gemma_engine, served_model_name=MODEL) as server:
        done = run_lm_eval(server.base_url, tasks, out)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    pairs = scored_pairs(out)
    assert len(pairs) == sum(len(doc["choices"]) for doc in DOCS)

    for k, (context, continuation, loglikelihood) in enumerate(pairs):
        ctx, cont = encode_pair(gemma_engine.tokenizer, context, continuation)
        ids = ctx + cont
        gemma_engine.add_request(f"ref-{k}", ids, SamplingParams(
            max_tokens=1, temperature=0, prompt_logprobs=0))
        result = None
        while gemma_engine.has_unfinished_requests():
            for output in gemma_engine.step():
                result = output
        positions = result.prompt_logprobs
        # The same floats summed in the same order: the same bits.
        engine_sum = sum(positions[i][ids[i]] for i in range(len(ctx), len(ids)))
        assert loglikelihood == engine_sum, (context, continuation)
        with torch.no_grad():
            logits = gemma_hf(torch.tensor([ids])).logits[0].float()
        reference = torch.log_softmax(logits, -1)
        hf_sum = sum(reference[i - 1, ids[i]].item() for i in range(len(ctx), len(ids)))
        assert abs(loglikelihood - hf_sum) < 2e-3 * len(cont), (context, hf_sum)
    assert gemma_engine.kv_pool_all_free
