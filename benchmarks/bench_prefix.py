"""Prefix caching: prompts that share a long prefix, with the cache on and off.

vLLM's prefix-repetition shape: `--num-prompts` prompts share a `--prefix-tokens` prefix
(a system prompt, a few-shot block, a document) and differ in a `--suffix-tokens` suffix;
each generates `--output-tokens` greedy tokens. Measured with the cache on and off, in one
process on the same weights:

- TTFT of one prompt whose prefix is cached (another prompt with the same prefix ran just
  before) against the same prompt with the cache off (median of up to 5 pairs);
- the whole workload submitted at once (chunked prefill, continuous batching): output and
  total tokens per second;
- the cost of the cache when nothing is shared: `--distinct-prompts` distinct prompts of the
  same length, cache on against off (hashing and lookups only).

There is no peer row: transformers has no cross-request cache, and llama.cpp's only keeps
the single previous context.
"""

from __future__ import annotations

from typing import Any

import common as c

NAME = "prefix"
TITLE = "Prefix caching: prompts sharing a long prefix, cache on and off"


def ttft_ms(engine: Any, rid: str, ids: list[int]) -> float:
    """Milliseconds until the request's first token (it generates only that one)."""
    from loom import SamplingParams

    start = c.now()
    engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=1))
    c.settle(engine)
    return (c.now() - start) * 1e3


def workload(engine: Any, prompts: list[list[int]], output_tokens: int, tag: str) -> dict:
    """Submit every prompt at once and run them to completion; tokens per second."""
    from loom import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    before = engine.stats
    start = c.now()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
    c.settle(engine)
    took = c.now() - start
    after = engine.stats
    out_tokens = output_tokens * len(prompts)
    in_tokens = sum(len(p) for p in prompts)
    return {
        "seconds": round(took, 3),
        "output_tok_s": round(out_tokens / took, 2),
        "total_tok_s": round((in_tokens + out_tokens) / took, 2),
        "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
        "prefix_cache_queries": after.prefix_cache_queries - before.prefix_cache_queries,
    }


def run_modes(args: Any, shared: list[list[int]], distinct: list[list[int]],
              num_blocks: int) -> dict[str, dict]:
    """Every measurement with the prefix cache on and off: two engines, measured in turns
    (on, off, on, off, ...) so that a slower stretch of a shared machine hits both."""
    engines = {cache: c.make_engine(args, num_kv_blocks=num_blocks, enable_prefix_caching=cache,
                                    max_num_batched_tokens=512)
               for cache in (True, False)}
    rows: dict[bool, dict[str, Any]] = {True: {}, False: {}}
    ttfts: dict[bool, list[float]] = {True: [], False: []}
    for engine in engines.values():
        ttft_ms(engine, "warmup", distinct[0][:64])
    for r in range(args.ttft_repeats):
        for cache, engine in engines.items():
            ttft_ms(engine, f"prime-{r}", shared[2 * r])  # the prefix enters the cache (if on)
            ttfts[cache].append(ttft_ms(engine, f"probe-{r}", shared[2 * r + 1]))
    for cache in engines:
        rows[cache]["ttft_ms"] = round(c.median(ttfts[cache]), 2)
        rows[cache]["ttft_ms_all"] = [round(t, 2) for t in ttfts[cache]]
    for name, prompts, out_tokens in (("shared", shared, args.output_tokens),
                                      ("distinct", distinct, args.distinct_output_tokens)):
        runs: dict[bool, list[dict]] = {True: [], False: []}
        for r in range(args.repeats):
            for cache, engine in engines.items():
                engine.reset_prefix_cache()  # each run starts from an empty cache
                runs[cache].append(workload(engine, prompts, out_tokens, f"{name}-{r}"))
        for cache in engines:
            rows[cache][name] = max(runs[cache], key=lambda x: x["total_tok_s"])
            rows[cache][f"{name}_total_tok_s_all"] = [x["total_tok_s"] for x in runs[cache]]
    for cache, engine in engines.items():
        assert engine.kv_pool_all_free, "the benchmark leaked KV blocks"
        c.log(f"loom cache={'on' if cache else 'off'}: {rows[cache]}")
    return {"loom cache on": rows[True], "loom cache off": rows[False]}


def main() -> None:
    """Parse arguments, run the cache on and off, report."""
    parser = c.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=None, help="default 32 (quick 8)")
    parser.add_argument("--prefix-tokens", type=int, default=None,
                        help="default 1024 (quick 512)")
    parser.add_argument("--suffix-tokens", type=int, default=None, help="default 64 (quick 32)")
    parser.add_argument("--output-tokens", type=int, default=None, help="default 64 (quick 16)")
    parser.add_argument("--distinct-prompts", type=int, default=None,
                        help="prompts of the no-sharing workload (default 8, quick 4)")
    parser.add_argument("--distinct-output-tokens", type=int, default=16)
    args = parser.parse_args()
    if args.doc_only:
        return c.rerender(NAME, TITLE, render)
    args.num_prompts = args.num_prompts or (8 if args.quick else 32)
    args.prefix_tokens = args.prefix_tokens or (512 if args.quick else 1024)
    args.suffix_tokens = args.suffix_tokens or (32 if args.quick else 64)
    args.output_tokens = args.output_tokens or (16 if args.quick else 64)
    args.distinct_prompts = args.distinct_prompts or (4 if args.quick else 8)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.ttft_repeats = min(5, args.num_prompts // 2)

    probe = c.make_engine(args, num_kv_blocks=64)
    tok, dtype = probe.tokenizer, probe.config.dtype
    del probe
    prefix = c.prompt_token_ids(tok, args.prefix_tokens, seed=1)
    length = args.prefix_tokens + args.suffix_tokens
    shared = [prefix + c.prompt_token_ids(tok, args.suffix_tokens + 1, seed=100 + i)[1:]
              for i in range(args.num_prompts)]
    distinct = [c.prompt_token_ids(tok, length, seed=1000 + i)
                for i in range(args.distinct_prompts)]
    per_request = (length + max(args.output_tokens, args.distinct_output_tokens)) // 16 + 2
    num_blocks = per_request * (args.num_prompts + 1) + 64  # no preemption either way

    results = run_modes(args, shared, distinct, num_blocks)
    on, off = results["loom cache on"], results["loom cache off"]
    summary = {
        "ttft_cached_over_uncached": c.ratio(on["ttft_ms"], off["ttft_ms"]),
        "shared_throughput_gain": c.ratio(on["shared"]["total_tok_s"],
                                          off["shared"]["total_tok_s"]),
        "shared_output_throughput_gain": c.ratio(on["shared"]["output_tok_s"],
                                                 off["shared"]["output_tok_s"]),
        "distinct_cost": c.ratio(off["distinct"]["total_tok_s"], on["distinct"]["total_tok_s"]),
    }
    c.log(f"summary: {summary}")
    sizes = (f"{args.num_prompts} prompts = {args.prefix_tokens}-token shared prefix + "
             f"{args.suffix_tokens}-token suffix, {args.output_tokens} output tokens; no-sharing "
             f"workload {args.distinct_prompts} x {length} tokens, "
             f"{args.distinct_output_tokens} output tokens; workloads best of {args.repeats}, "
             f"TTFT median of {args.ttft_repeats}")
    result = c.header(NAME, args, dtype=dtype, quantization=args.quantization,
                      sizes_note=sizes, results=results, summary=summary, skipped=[])
    c.finish(NAME, TITLE, result, render, args.no_doc)


def render(result: dict[str, Any]) -> str:
    """The doc section's body: one row per cache setting, then the ratios."""
    res, s = result["results"], result["summary"]
    rows = [[name, r["ttft_ms"], r["shared"]["output_tok_s"], r["shared"]["total_tok_s"],
             r["shared"]["prefix_cache_hits"], r["distinct"]["total_tok_s"]]
            for name, r in res.items()]
    table = c.markdown_table(
        ["engine", "TTFT ms (prefix cached when on)", "shared workload output tok/s",
         "shared workload total tok/s", "tokens from cache", "no-sharing total tok/s"], rows)
    return (f"{table}\n\nTTFT with the prefix cached is {c.fmt(s['ttft_cached_over_uncached'])}"
            f" of the uncached TTFT (target at most 0.10); the shared workload runs "
            f"{c.fmt(s['shared_throughput_gain'])}x faster with the cache (output tokens: "
            f"{c.fmt(s['shared_output_throughput_gain'])}x; target at least 3x); with nothing "
            f"shared the cache costs {c.fmt(s['distinct_cost'])}x (target at most 1.03x).")


if __name__ == "__main__":
    main()
