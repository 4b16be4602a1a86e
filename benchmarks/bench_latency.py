"""Single-stream latency: time to first token and greedy decode tokens/s, Loom against peers.

For each prompt length (default 512 and 2048 tokens) one request generates `--max-tokens`
tokens greedily with EOS ignored; each repeat has a prompt of its own (no prefix-cache hit).
TTFT is the time from submitting to the first token;
decode tokens/s is (n - 1) / (time of the last token - time of the first). Engines: Loom at
its default dtype and the `--loom-modes` variants (int8, w8a8, a float16 KV cache, n-gram
speculative decoding), HF transformers at Loom's dtype and in bf16 (and bf16 with its
prompt-lookup decoding, the peer of Loom's "+ngram"), llama.cpp on the same GGUF file.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import common as c

NAME = "latency"
TITLE = "Latency: time to first token and single-stream decode"

# A runner takes prompt ids and a token count; returns (submit time, token arrival times).
Runner = Callable[[list[int], int], tuple[float, list[float]]]


def loom_runner(engine: Any) -> Runner:
    """Greedy single-request generation on a Loom engine, timestamping each token."""
    from loom import SamplingParams

    ids = itertools.count()

    def run(prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
        rid = f"lat-{next(ids)}"
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        times: list[float] = []
        start = c.now()
        engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                got = len(out.outputs[0].token_ids)
                times.extend([c.now()] * (got - len(times)))
        return start, times

    return run


def hf_runner(hf: Any, prompt_lookup: int | None = None, static_cache: bool = False) -> Runner:
    """HF `generate` (greedy, EOS ignored) with a streamer that timestamps each token;
    `prompt_lookup`: its prompt-lookup speculative decoding with that many draft tokens;
    `static_cache`: its static KV cache, with which transformers compiles the forward
    (`torch.compile`; the first call compiles, the warmup pays it)."""
    import torch

    extra: dict[str, Any] = {}
    if prompt_lookup is not None:
        extra["prompt_lookup_num_tokens"] = prompt_lookup
    if static_cache:
        extra["cache_implementation"] = "static"

    def run(prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
        input_ids = torch.tensor([prompt], device=hf.device)
        streamer = c.TimestampStreamer()
        start = c.now()
        with torch.inference_mode():
            hf.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                top_p=None,
                top_k=None,
                pad_token_id=c.hf_pad_id(hf),
                streamer=streamer,
                **extra,
            )
        return start, streamer.times

    return run


def llama_cpp_runner(llm: Any) -> Runner:
    """llama.cpp greedy generation from an empty cache, timestamping each token."""

    def run(prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
        llm.reset()
        c.llama_cpp_truncate(llm, 0)
        times: list[float] = []
        start = c.now()
        for _ in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=False):
            times.append(c.now())
            if len(times) >= max_tokens:
                break
        return start, times

    return run


def timed_run(run: Runner, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(TTFT ms, decode tokens/s after the first token) of one run of `prompt`."""
    start, times = run(prompt, max_tokens)
    assert len(times) == max_tokens, f"got {len(times)} tokens, wanted {max_tokens}"
    return (times[0] - start) * 1e3, (len(times) - 1) / (times[-1] - times[0])


def measure(run: Runner, prompts: list[list[int]], warmup: list[int],
            max_tokens: int) -> dict[str, Any]:
    """Median TTFT (ms) and decode tokens/s over one run per prompt, after one short warmup.

    Every run gets a prompt no earlier run has seen (nor the warmup), so an engine with a
    prefix cache (Loom's is on by default) computes each prompt in full: a repeat of one
    prompt would measure a cache hit, not a prefill."""
    run(warmup, 4)
    ttfts, rates = [], []
    for prompt in prompts:
        ttft, rate = timed_run(run, prompt, max_tokens)
        ttfts.append(ttft)
        rates.append(rate)
    return {
        "ttft_ms": round(c.median(ttfts), 2),
        "decode_tok_s": round(c.median(rates), 3),
        "ttft_ms_all": [round(t, 2) for t in ttfts],
        "decode_tok_s_all": [round(r, 3) for r in rates],
    }


def main() -> None:
    """Parse arguments, run every engine on every prompt length, report."""
    parser = c.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=None)
    parser.add_argument("--max-tokens", type=int, default=None, help="decode length (128)")
    parser.add_argument("--hf-dtypes", nargs="+", default=None,
                        help="HF dtypes ('same' = Loom's); default: same bfloat16 (quick: same)")
    parser.add_argument("--loom-modes", nargs="*",
                        default=["int8", "w8a8", "w8a8+kv16", "w8a8+kv16+ngram"],
                        help="Loom variants besides its dtype: quantization modes, '+kv16' for "
                             "a float16 KV cache, '+ngram' for n-gram speculative decoding")
    parser.add_argument("--hf-static-cache", action="store_true",
                        help="also run HF bf16 with its static cache, compiled by torch.compile "
                             "(its fastest decode; the peer the CUDA targets name)")
    parser.add_argument("--hf-prompt-lookup", type=int, default=4,
                        help="also run HF bf16 with prompt-lookup decoding with this many "
                             "drafts (0: off; the peer of Loom's '+ngram')")
    args = parser.parse_args()
    if args.doc_only:
        return c.rerender(NAME, TITLE, render)
    prompt_lens = args.prompt_lens or [512, 2048]
    max_tokens = args.max_tokens or (16 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 3)

    engine = c.make_engine(args)
    dtype = engine.config.dtype
    label = c.engine_label(engine.config)
    # One distinct prompt per (length, repeat), the same ones for every engine.
    prompts = {n: [c.prompt_token_ids(engine.tokenizer, n, seed=n * 100 + r)
                   for r in range(repeats)] for n in prompt_lens}
    warmup = c.prompt_token_ids(engine.tokenizer, 32, seed=1)
    runners: list[tuple[str, Callable[[], Runner | None]]] = [
        (f"loom {label}", lambda: loom_runner(engine)),
    ]
    for mode in args.loom_modes:
        runners.append((f"loom {mode}", lambda m=mode: _variant(args, m)))
    if not args.no_hf:
        default_dtypes = ["same"] if args.quick else ["same", "bfloat16"]
        for hf_dtype in dict.fromkeys(args.hf_dtypes or default_dtypes):
            hf_dtype = dtype if hf_dtype == "same" else hf_dtype
            runners.append((f"transformers {hf_dtype}", lambda d=hf_dtype: _hf(args, d)))
        if args.hf_prompt_lookup and not args.quick:
            runners.append((f"transformers bfloat16+ngram{args.hf_prompt_lookup}",
                             lambda: _hf(args, "bfloat16", args.hf_prompt_lookup)))
        if args.hf_static_cache:
            runners.append(("transformers bfloat16 (static cache, compiled)",
                            lambda: _hf(args, "bfloat16", static_cache=True)))
    else:
        c.skip("transformers: skipped (--no-hf)")
    if not args.no_llama_cpp:
        n_ctx = max(prompt_lens) + max_tokens + 64
        runners.append(("llama.cpp Q4_K_M", lambda: _llama(args, n_ctx)))
    else:
        c.skip("llama.cpp: skipped (--no-llama-cpp)")

    results: dict[str, dict[str, Any]] = {}
    skipped: list[str] = []
    for name, make in runners:
        run = make()
        if run is None:
            skipped.append(name)
            continue
        results[name] = {}
        for n, per_repeat in prompts.items():
            c.log(f"{name}: prompt {n}, {max_tokens} tokens, {repeats} repeat(s)")
            results[name][str(n)] = measure(run, per_repeat, warmup, max_tokens)
        del run
    base = runners[0][0]  # Loom as the arguments ask (the engine's default mode unless told)
    ratios = {
        peer: {
            n: {
                "ttft_peer_over_loom": c.ratio(r[n]["ttft_ms"], results[base][n]["ttft_ms"]),
                "decode_loom_over_peer": c.ratio(
                    results[base][n]["decode_tok_s"], r[n]["decode_tok_s"]
                ),
            }
            for n in r
        }
        for peer, r in results.items()
        if peer != base
    }
    sizes = (f"prompts {prompt_lens} tokens, {max_tokens} generated, median of {repeats} "
             "distinct prompts")
    result = c.header(NAME, args, dtype=dtype, base=base, sizes_note=sizes,
                      prompt_lens=prompt_lens,
                      max_tokens=max_tokens, repeats=repeats, results=results, ratios=ratios,
                      skipped=skipped)
    c.finish(NAME, TITLE, result, render, args.no_doc)


def _variant(args: Any, mode: str) -> Runner | None:
    engine = c.try_variant_engine(args, mode)
    return None if engine is None else loom_runner(engine)


def _hf(args: Any, dtype: str, prompt_lookup: int | None = None,
        static_cache: bool = False) -> Runner | None:
    hf = c.load_hf(args.model, dtype, device=c.peer_device(args))
    return None if hf is None else hf_runner(hf, prompt_lookup, static_cache)


def _llama(args: Any, n_ctx: int) -> Runner | None:
    llm = c.load_llama_cpp(args.model, n_ctx, args.threads)
    return None if llm is None else llama_cpp_runner(llm)


def render(result: dict[str, Any]) -> str:
    """The doc section's body: one row per engine and prompt length."""
    base = result.get("base", f"loom {result['dtype']}")
    rows = []
    for label, per_len in result["results"].items():
        for n, r in per_len.items():
            rat = result["ratios"].get(label, {}).get(n, {})
            rows.append([label, n, r["ttft_ms"], r["decode_tok_s"],
                         rat.get("ttft_peer_over_loom"), rat.get("decode_loom_over_peer")])
    table = c.markdown_table(
        ["engine", "prompt tokens", "TTFT ms", "decode tok/s",
         f"TTFT peer/{base}", f"decode {base}/peer"],
        rows,
    )
    notes = c.skip_notes_md(result)
    return (f"{table}\n\nRatios above 1 favour Loom. Decode tok/s is measured after the "
            f"prompt, so at the longer prompt it includes attention over that context.{notes}\n\n"
            "![latency](bench_latency.png)")


if __name__ == "__main__":
    main()
