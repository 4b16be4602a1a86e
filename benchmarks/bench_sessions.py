"""Live appends: the cost of appending k tokens to a live session as its context grows.

`--num-sessions` madlibs sessions live in one engine at once. The context of every session
is grown through `--contexts` (each step: a short generated fill, then filler text up to the
exact length). At each length every session gets a live append of `--append-tokens` tokens
(timed until its logits are ready, then rewound so the length stays exact), and the same
text is re-submitted once as a fresh request: with the prefix cache on it finds the
session's blocks (a cache hit), with it off (a second engine) it computes everything (the
cost without sessions or a cache). The peers do what
a session does with their own cache: HF transformers forwards only the new tokens with
`past_key_values` (its `DynamicCache`), llama.cpp evaluates them on its existing context.
A live append costs O(k) work plus attention over the context, so its time should stay
nearly flat while re-submitting grows with the context.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import common as c

NAME = "sessions"
TITLE = "Live sessions: appending k tokens at growing context lengths"
MADLIBS = "Once upon a time, in a kingdom called"
FILL_TOKENS = 4


def run_loom(engine: Any, uncached: Any, args: Any, streams: list[list[int]],
             append: list[int]) -> dict:
    """Grow every session through the contexts; time live appends and re-submits (to the
    same engine, a prefix-cache hit, and to `uncached`, an engine without the cache)."""
    from loom import SamplingParams

    fill = SamplingParams(temperature=0.0, max_tokens=FILL_TOKENS, ignore_eos=True)
    sids = [f"story-{i}" for i in range(args.num_sessions)]
    for sid, stream in zip(sids, streams, strict=True):
        engine.add_request(sid, stream[:16], session=True)
    c.settle(engine)
    out: dict[str, Any] = {}
    for n_ctx in args.contexts:
        for sid in sids:  # the madlibs fill, then filler up to the exact length
            engine.resume(sid, fill)
        c.settle(engine)
        for sid, stream in zip(sids, streams, strict=True):
            have = len(engine.get_session(sid).token_ids)
            if have < n_ctx:
                engine.append(sid, stream[have:n_ctx])
        c.settle(engine)
        live = []
        for sid in sids:
            for _ in range(args.repeats):
                start = c.now()
                engine.append(sid, append)
                c.settle(engine)
                live.append((c.now() - start) * 1e3)
                engine.rewind(sid, len(append))
                c.settle(engine)
        row: dict[str, Any] = {"live_ms": round(c.median(live), 2),
                               "live_ms_all": [round(t, 2) for t in live]}
        if args.resubmit_max is None or n_ctx <= args.resubmit_max:
            full = list(engine.get_session(sids[0]).token_ids) + append
            for key, target in (("resubmit_ms", uncached), ("resubmit_cached_ms", engine)):
                start = c.now()
                target.add_request(f"resubmit-{n_ctx}", full, session=True)
                c.settle(target)
                row[key] = round((c.now() - start) * 1e3, 2)
                target.close(f"resubmit-{n_ctx}")
            row["live_over_resubmit"] = c.ratio(row["live_ms"], row["resubmit_ms"])
        row["num_recomputed_tokens"] = engine.num_recomputed_tokens
        out[str(n_ctx)] = row
        c.log(f"loom: context {n_ctx}: {row}")
    for sid in sids:
        engine.close(sid)
    return out


def run_hf(hf: Any, stream: list[int], append: list[int], args: Any) -> dict:
    """HF: one cache grown through the contexts; the append forwards only the new tokens."""
    import torch

    out: dict[str, Any] = {}
    cache, have = None, 0
    with torch.inference_mode():
        for n_ctx in args.contexts:
            for lo in range(have, n_ctx, 512):  # grow in chunks, untimed
                ids = torch.tensor([stream[lo : min(lo + 512, n_ctx)]], device=hf.device)
                cache = hf(ids, past_key_values=cache, use_cache=True).past_key_values
            have = n_ctx
            times = []
            new = torch.tensor([append], device=hf.device)
            hf(new, past_key_values=copy.deepcopy(cache), use_cache=True)  # warmup
            for _ in range(args.repeats * 2):
                trial = copy.deepcopy(cache)
                c.device_sync()
                start = c.now()
                hf(new, past_key_values=trial, use_cache=True)
                c.device_sync()
                times.append((c.now() - start) * 1e3)
                del trial
            out[str(n_ctx)] = {"append_ms": round(c.median(times), 2)}
            c.log(f"transformers: context {n_ctx}: {out[str(n_ctx)]}")
    return out


def run_llama_cpp(llm: Any, stream: list[int], append: list[int], args: Any) -> dict:
    """llama.cpp: one context grown through the lengths; the append evaluates k tokens."""
    out: dict[str, Any] = {}
    llm.reset()
    c.llama_cpp_truncate(llm, 0)
    for n_ctx in args.contexts:
        llm.eval(stream[llm.n_tokens : n_ctx])
        times = []
        for i in range(args.repeats * 2 + 1):
            start = c.now()
            llm.eval(append)
            if i:  # the first is a warmup
                times.append((c.now() - start) * 1e3)
            c.llama_cpp_truncate(llm, n_ctx)
        out[str(n_ctx)] = {"append_ms": round(c.median(times), 2)}
        c.log(f"llama.cpp: context {n_ctx}: {out[str(n_ctx)]}")
    return out


def main() -> None:
    """Parse arguments, run Loom and the peers, report."""
    parser = c.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--num-sessions", type=int, default=None, help="default 8 (quick 2)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="default 256 512 1024 2048 4096 (quick: up to 1024)")
    parser.add_argument("--append-tokens", type=int, default=16)
    parser.add_argument("--loom-quantization", nargs="*", default=["float"],
                        help="also run these Loom variants (default: float, exact float "
                             "weights; see common.loom_mode_kwargs)")
    parser.add_argument("--resubmit-max", type=int, default=None,
                        help="re-submit only up to this context (default: all)")
    args = parser.parse_args()
    if args.doc_only:
        return c.rerender(NAME, TITLE, render)
    args.num_sessions = args.num_sessions or (2 if args.quick else 8)
    args.contexts = sorted(args.contexts or ([256, 512, 1024] if args.quick
                                             else [256, 512, 1024, 2048, 4096]))
    args.repeats = args.repeats or (1 if args.quick else 2)
    max_len = max(args.contexts) + args.append_tokens
    # Every session at the longest context, plus one re-submit, without preemption.
    blocks = (args.num_sessions + 1) * (math.ceil(max_len / 16) + 2) + 16
    results: dict[str, Any] = {}
    skipped: list[str] = []
    for mode in ["default", *args.loom_quantization]:
        variant = {} if mode == "default" else c.loom_mode_kwargs(mode)
        engine = c.make_engine(args, num_kv_blocks=blocks, max_model_len=max_len + 64, **variant)
        uncached = c.make_engine(args, num_kv_blocks=max_len // 16 + 16,
                                 max_model_len=max_len + 64, enable_prefix_caching=False,
                                 **variant)
        if mode == "default":
            dtype = engine.config.dtype
            tok = engine.tokenizer
            prefix = tok.encode(MADLIBS, add_special_tokens=True)
            streams = [prefix + c.prompt_token_ids(tok, max_len, seed=100 + i)[1:]
                       for i in range(args.num_sessions)]
            append = c.prompt_token_ids(tok, args.append_tokens + 1, seed=7)[1:]
        c.log(f"loom {mode}")
        results["loom" if mode == "default" else f"loom {mode}"] = run_loom(
            engine, uncached, args, streams, append
        )
        assert engine.kv_pool_all_free, "sessions leaked KV blocks"
        del engine, uncached

    hf = c.load_hf(args.model, dtype, device=c.peer_device(args), disabled=args.no_hf)
    if hf is None:
        skipped.append("transformers")
    else:
        results["transformers"] = run_hf(hf, streams[0], append, args)
        del hf
    llm = c.load_llama_cpp(args.model, max_len + 32, args.threads,
                           disabled=args.no_llama_cpp)
    if llm is None:
        skipped.append("llama.cpp")
    else:
        results["llama.cpp"] = run_llama_cpp(llm, streams[0], append, args)

    loom = results["loom"]
    lo, hi = str(args.contexts[0]), str(args.contexts[-1])
    summary = {"loom_live_growth": c.ratio(loom[hi]["live_ms"], loom[lo]["live_ms"])}
    sizes = (f"{args.num_sessions} live sessions, contexts {args.contexts}, appends of "
             f"{args.append_tokens} tokens, {args.repeats} repeat(s) per session")
    result = c.header(NAME, args, dtype=dtype, sizes_note=sizes, contexts=args.contexts,
                      num_sessions=args.num_sessions, append_tokens=args.append_tokens,
                      results=results, summary=summary, skipped=skipped)
    c.finish(NAME, TITLE, result, render, args.no_doc)


def render(result: dict[str, Any]) -> str:
    """The doc section's body: one row per context length."""
    res = result["results"]
    rows = []
    for n in map(str, result["contexts"]):
        lm = res["loom"][n]
        hf = res.get("transformers", {}).get(n, {}).get("append_ms")
        lc = res.get("llama.cpp", {}).get(n, {}).get("append_ms")
        variants = [k for k in res if k.startswith("loom") and n in res[k]]
        for label in variants:
            lm = res[label][n]
            name = f"{label} {result['dtype']}" if label == "loom" else label
            rows.append([n, name, lm["live_ms"], lm.get("resubmit_ms"),
                         lm.get("resubmit_cached_ms"),
                         lm.get("live_over_resubmit"), hf, lc, c.ratio(lm["live_ms"], hf),
                         c.ratio(lm["live_ms"], lc)])
    table = c.markdown_table(
        ["context", "Loom", "live append ms", "re-submit ms (no cache)",
         "re-submit ms (prefix cache hit)", "live/re-submit",
         "HF DynamicCache append ms", "llama.cpp append ms", "Loom/HF time",
         "Loom/llama.cpp time"],
        rows,
    )
    growth = result["summary"]["loom_live_growth"]
    notes = c.skip_notes_md(result)
    return (f"{table}\n\nAppends of {result['append_tokens']} tokens, times in ms (lower is "
            "better; time ratios below 1 favour Loom). Loom's live append grows "
            f"{fmt_x(growth)} from the shortest to the longest context; `live/re-submit` is "
            "the share of a fresh request's cost (without the prefix cache) that a live "
            "append pays; with the cache a re-submission finds the session's full blocks and "
            "computes only the last partial block and the new tokens. Each Loom append is "
            "rewound afterwards (`rewind` recomputes one token, counted in the JSON's "
            f"`num_recomputed_tokens`).{notes}\n\n![sessions](bench_sessions.png)")


def fmt_x(value: float | None) -> str:
    """A growth factor such as 1.3x."""
    return "—" if value is None else f"{value:.2f}x"


if __name__ == "__main__":
    main()
