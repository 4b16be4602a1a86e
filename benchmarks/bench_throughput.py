"""Offline throughput on a batch of mixed-length prompts (vLLM's benchmark_throughput shape).

`--num-prompts` prompts with input lengths drawn uniformly from [--input-min, --input-max]
and output lengths from [--output-min, --output-max] (fixed seed). Every engine generates
exactly the requested number of tokens per prompt (EOS ignored). Reported: output tokens/s
and total (prompt + output) tokens/s over the wall time of the whole batch.

- Loom: one `LLM.generate` call with all prompts (continuous batching).
- HF transformers: `generate` in batches of `--hf-batch-size` with left padding; prompts are
  grouped by output length (longest first) and each batch generates its longest output, so
  only the requested tokens are counted (as vLLM's HF backend does).
- llama.cpp: one prompt after another (llama-cpp-python's high-level API serves one
  sequence at a time).
"""

from __future__ import annotations

import random
from typing import Any

import common as c

NAME = "throughput"
TITLE = "Offline throughput: a batch of mixed-length prompts"


def make_workload(tokenizer: Any, args: Any) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs drawn with a fixed seed."""
    rng = random.Random(args.seed)
    work = []
    for i in range(args.num_prompts):
        n_in = rng.randint(args.input_min, args.input_max)
        n_out = rng.randint(args.output_min, args.output_max)
        work.append((c.prompt_token_ids(tokenizer, n_in, seed=args.seed * 1000 + i), n_out))
    return work


def run_loom(llm: Any, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    """All prompts in one `LLM.generate` call, after a warmup on two prompts of their own
    (warming up on the workload's would give those a prefix-cache hit in the timed run)."""
    from loom import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    warmup = [c.prompt_token_ids(llm.tokenizer, len(p), seed=-1 - i)
              for i, (p, _) in enumerate(work[:2])]
    llm.generate(warmup, params[:2], use_tqdm=False)
    start = c.now()
    outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    elapsed = c.now() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(n for _, n in work), "Loom produced fewer tokens than asked"
    return _rates(work, elapsed)


def run_hf(hf: Any, work: list[tuple[list[int], int]], batch: int) -> dict[str, Any]:
    """HF generate in left-padded batches grouped by output length."""
    import torch

    order = sorted(range(len(work)), key=lambda i: -work[i][1])
    batches = [order[i : i + batch] for i in range(0, len(order), batch)]

    pad = c.hf_pad_id(hf)

    def run_batch(idx: list[int]) -> None:
        width = max(len(work[i][0]) for i in idx)
        ids = [[pad] * (width - len(work[i][0])) + work[i][0] for i in idx]  # left padding
        mask = [[0] * (width - len(work[i][0])) + [1] * len(work[i][0]) for i in idx]
        n_out = max(work[i][1] for i in idx)
        with torch.inference_mode():
            hf.generate(input_ids=torch.tensor(ids, device=hf.device),
                        attention_mask=torch.tensor(mask, device=hf.device),
                        max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False,
                        top_p=None, top_k=None, pad_token_id=pad)

    run_batch(batches[-1][:2])  # warmup
    start = c.now()
    for idx in batches:
        run_batch(idx)
    return _rates(work, c.now() - start)


def run_llama_cpp(llm: Any, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    """One prompt after another on llama.cpp, each from an empty cache."""

    def one(prompt: list[int], n_out: int) -> None:
        llm.reset()
        c.llama_cpp_truncate(llm, 0)
        for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0,
                                           reset=False)):
            if i + 1 >= n_out:
                break

    one(work[0][0][:16], 2)  # warmup
    start = c.now()
    for prompt, n_out in work:
        one(prompt, n_out)
    return _rates(work, c.now() - start)


def _rates(work: list[tuple[list[int], int]], elapsed: float) -> dict[str, Any]:
    n_in = sum(len(p) for p, _ in work)
    n_out = sum(n for _, n in work)
    return {
        "elapsed_s": round(elapsed, 3),
        "requests_s": round(len(work) / elapsed, 4),
        "output_tok_s": round(n_out / elapsed, 3),
        "total_tok_s": round((n_in + n_out) / elapsed, 3),
    }


def main() -> None:
    """Parse arguments, run each engine on the same workload, report."""
    parser = c.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=None, help="default 64 (quick 8)")
    parser.add_argument("--input-min", type=int, default=None, help="default 64 (quick 32)")
    parser.add_argument("--input-max", type=int, default=None, help="default 512 (quick 128)")
    parser.add_argument("--output-min", type=int, default=None, help="default 64 (quick 8)")
    parser.add_argument("--output-max", type=int, default=None, help="default 256 (quick 32)")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--hf-dtypes", nargs="+", default=["same"],
                        help="HF dtypes to run ('same' = Loom's dtype), e.g. same bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loom-modes", nargs="+", default=["default", "float"],
                        help="Loom variants: 'default' (the engine's defaults), 'float' (exact "
                             "float weights), quantization modes (int8, w8a8), '+kv16' for a "
                             "float16 KV cache; the first is the ratios' base")
    args = parser.parse_args()
    if args.doc_only:
        return c.rerender(NAME, TITLE, render)
    quick = {"num_prompts": 8, "input_min": 32, "input_max": 128,
             "output_min": 8, "output_max": 32}
    full = {"num_prompts": 64, "input_min": 64, "input_max": 512,
            "output_min": 64, "output_max": 256}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    from loom import LLM

    results: dict[str, Any] = {}
    skipped: list[str] = []
    dtype, work, base = None, [], None
    for mode in args.loom_modes:
        llm = LLM(model=args.model, dtype=args.dtype, device=args.device,
                  kv_cache_memory_gb=2.0, **c.loom_mode_kwargs(mode))
        if dtype is None:
            dtype = llm.engine.config.dtype
            work = make_workload(llm.tokenizer, args)
        label = f"loom {c.engine_label(llm.engine.config)}"
        if mode == "default":
            label += " (default)"
        elif mode.startswith("default+"):  # the defaults but one knob: name the knob
            label += f" ({mode})"
        base = base or label
        c.log(f"{label}: {len(work)} prompts")
        results[label] = run_loom(llm, work)
        del llm

    for hf_dtype in dict.fromkeys(dtype if d == "same" else d for d in args.hf_dtypes):
        label = f"transformers {hf_dtype} (batches of {args.hf_batch_size})"
        hf = c.load_hf(args.model, hf_dtype, device=c.peer_device(args),
                       disabled=args.no_hf)
        if hf is None:
            skipped.append(label)
            continue
        c.log(f"{label}: {len(work)} prompts")
        results[label] = run_hf(hf, work, args.hf_batch_size)
        del hf
    label = "llama.cpp Q4_K_M (sequential)"
    n_ctx = args.input_max + args.output_max + 16
    llm_cpp = c.load_llama_cpp(args.model, n_ctx, args.threads, disabled=args.no_llama_cpp)
    if llm_cpp is None:
        skipped.append(label)
    else:
        c.log(f"{label}: {len(work)} prompts")
        results[label] = run_llama_cpp(llm_cpp, work)

    ratios = {k: {"output_loom_over_peer": c.ratio(results[base]["output_tok_s"],
                                                   v["output_tok_s"])}
              for k, v in results.items() if k != base}
    sizes = (f"{args.num_prompts} prompts, {args.input_min}-{args.input_max} tokens in, "
             f"{args.output_min}-{args.output_max} out, seed {args.seed}")
    result = c.header(NAME, args, dtype=dtype, sizes_note=sizes,
                      workload={k: getattr(args, k) for k in full} | {"seed": args.seed},
                      prompt_tokens=sum(len(p) for p, _ in work),
                      output_tokens=sum(n for _, n in work), base=base,
                      results=results, ratios=ratios, skipped=skipped)
    c.finish(NAME, TITLE, result, render, args.no_doc)


def render(result: dict[str, Any]) -> str:
    """The doc section's body: one row per engine."""
    base = result.get("base") or f"loom {result['dtype']}"
    ratios = result["ratios"]
    rows = [[k, v["elapsed_s"], v["output_tok_s"], v["total_tok_s"],
             ratios.get(k, {}).get("output_loom_over_peer")]
            for k, v in result["results"].items()]
    table = c.markdown_table(["engine", "wall s", "output tok/s", "total tok/s",
                              f"output {base}/peer"], rows)
    return (f"{table}\n\nRatios above 1 favour Loom.{c.skip_notes_md(result)}\n\n"
            "![throughput](bench_throughput.png)")


if __name__ == "__main__":
    main()
