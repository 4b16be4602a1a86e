"""Paired decode: Loom against llama.cpp on the same GGUF, both loaded in one process, taking
turns on the same prompts, so that both engines meet the same host.

`bench_model_sizes.py` measures each engine in a process of its own, one after the other:
on a host whose memory bandwidth drifts between minutes (a shared VM's: the read probe moves
between 31 and 52 GB/s within seconds), the two engines' rows can see different machines and
their ratio moves with it. Here each round runs one prompt on both engines back to back,
the order alternating between rounds, and reports each round's ratio; the median of the
rounds' ratios is the comparison. Loom runs warm (a first load in a child process fills its
prepared-weights cache first, then `os.sync()`), in its default mode; llama.cpp as
`bench_model_sizes.py` loads it. Greedy decoding, EOS ignored (random weights). Before
each round the read probe of `bench_model_sizes.py` (a 2-thread sum over 256 MiB, best of 3)
records the bandwidth the host gives at that moment, beside the round's rates.

    python benchmarks/bench_paired_decode.py --gguf FILE.gguf [FILE.gguf ...] --rounds 6
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import bench_latency as bl
import common as c
import torch
from bench_model_sizes import read_bandwidth

NAME = "paired_decode"
TITLE = "Paired decode: Loom and llama.cpp taking turns in one process"


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`count` distinct random prompts of token ids away from the vocabulary's ends."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (length,), generator=g).tolist()
            for _ in range(count)]


def _first_load(path: Path) -> None:
    """Fill Loom's prepared-weights cache in a child process, then flush it to disk (the
    writeback would otherwise share the cores with the measurement)."""
    subprocess.run([sys.executable, "-c", f"from loom import LLM; LLM(model={str(path)!r})"],
                   check=True)
    os.sync()


def measure_file(path: Path, rounds: int, prompt_len: int, max_tokens: int,
                 threads: int) -> dict[str, Any]:
    """Per round: each engine's TTFT and decode tok/s on the round's prompt, and the
    ratios."""
    from loom import LLM

    _first_load(path)
    loom = LLM(model=str(path))
    llama = c.load_llama_cpp(str(path), prompt_len + max_tokens + 64, threads)
    if llama is None:
        raise SystemExit(f"llama.cpp could not load {path}")
    runners = {"loom": bl.loom_runner(loom.engine), "llama.cpp": bl.llama_cpp_runner(llama)}
    prompts = _prompts(rounds + 1, prompt_len, loom.engine.inputs.vocab_size, seed=7)
    for run in runners.values():
        run(prompts[0][:16], 4)  # warmup
    rows = []
    for r, prompt in enumerate(prompts[1:]):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        row: dict[str, Any] = {"round": r, "first": order[0],
                               "probe_gb_s": read_bandwidth(threads, 256, 3)["gb_s"]}
        for name in order:
            ttft, rate = bl.timed_run(runners[name], prompt, max_tokens)
            row[name] = {"ttft_ms": round(ttft, 1), "decode_tok_s": round(rate, 2)}
        row["decode_ratio"] = round(row["loom"]["decode_tok_s"]
                                    / row["llama.cpp"]["decode_tok_s"], 3)
        row["ttft_ratio"] = round(row["loom"]["ttft_ms"] / row["llama.cpp"]["ttft_ms"], 3)
        c.log(f"  round {r} ({order[0]} first, probe {row['probe_gb_s']:.1f} GB/s): "
              f"Loom {row['loom']['decode_tok_s']} tok/s, "
              f"llama.cpp {row['llama.cpp']['decode_tok_s']} tok/s: {row['decode_ratio']}x; "
              f"TTFT {row['ttft_ratio']}x")
        rows.append(row)
    return {
        "rounds": rows,
        "decode_ratio_median": c.median([r["decode_ratio"] for r in rows]),
        "decode_ratio_range": [min(r["decode_ratio"] for r in rows),
                               max(r["decode_ratio"] for r in rows)],
        "ttft_ratio_median": c.median([r["ttft_ratio"] for r in rows]),
        "loom_decode_tok_s_median": c.median([r["loom"]["decode_tok_s"] for r in rows]),
        "llama_cpp_decode_tok_s_median": c.median([r["llama.cpp"]["decode_tok_s"]
                                                   for r in rows]),
    }


def render(result: dict[str, Any]) -> str:
    """One row per file: the medians and the range of the rounds' decode ratios."""
    rows = [[name, len(r["rounds"]), r["loom_decode_tok_s_median"],
             r["llama_cpp_decode_tok_s_median"], r["decode_ratio_median"],
             f"{r['decode_ratio_range'][0]:.2f}-{r['decode_ratio_range'][1]:.2f}",
             r["ttft_ratio_median"]]
            for name, r in result["results"].items()]
    table = c.markdown_table(
        ["file", "rounds", "Loom decode tok/s (median)", "llama.cpp decode tok/s (median)",
         "decode Loom/llama.cpp (median of rounds)", "rounds' range", "TTFT Loom/llama.cpp"],
        rows)
    return (f"{table}\n\nEach round runs one {result['prompt_len']}-token prompt and "
            f"{result['max_tokens']} greedy tokens on both engines in one process, back to "
            "back, the order alternating; ratios above 1 (decode) and below 1 (TTFT) favour "
            "Loom.")


def main() -> None:
    parser = c.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, nargs="+", required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.doc_only:
        return c.rerender(NAME, TITLE, render)
    results = {}
    for path in args.gguf:
        path = path.expanduser()
        c.log(f"== {path.name}")
        results[path.stem] = measure_file(path, args.rounds, args.prompt_len,
                                          args.max_tokens, args.threads)
    args.model = ", ".join(p.name for p in args.gguf)
    result = c.header(NAME, args, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                      rounds=args.rounds, results=results, dtype="float32",
                      sizes_note=f"prompt {args.prompt_len} tokens, {args.max_tokens} greedy "
                                 f"tokens, {args.rounds} rounds; Loom's default mode; "
                                 f"{args.threads} threads")
    c.finish(NAME, TITLE, result, render, args.no_doc)
    return None


if __name__ == "__main__":
    main()
