"""Two Loom modes on one model, alternating in one process: decode tok/s and TTFT.

On a noisy host (a shared VM) separate runs of the same command can differ by a third; two
engines that take turns on the same prompts see the same noise, so their per-round ratio is
what a comparison can rest on. Prints one JSON object (rounds, best values, per-round ratios).

    python benchmarks/ab_modes.py --model F.gguf --modes w8a8 w4a8 --prompt 512 --tokens 64
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import common as c
from bench_latency import loom_runner


def run_once(runner: Any, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(TTFT s, decode tok/s) of one greedy request through bench_latency's runner."""
    start, times = runner(prompt, tokens)
    return times[0] - start, (len(times) - 1) / (times[-1] - times[0])


def main() -> None:
    """Parse the arguments, alternate the two engines, print the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--modes", nargs=2, default=["w8a8", "w4a8"])
    parser.add_argument("--kv-cache-dtype", default="float16")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--env-b", nargs="*", default=[], metavar="KEY=VALUE",
                        help="environment set while the second engine loads (an A/B of a "
                             "load-time switch; give the same mode twice)")
    args = parser.parse_args()

    from loom import LLM

    names = list(args.modes)
    if names[0] == names[1]:
        names[1] += " " + " ".join(args.env_b)
    engines = {}
    for name, mode, env in zip(names, args.modes, ([], args.env_b), strict=True):
        with c.environment(dict(item.split("=", 1) for item in env)):
            engines[name] = LLM(model=args.model, quantization=mode, enable_prefix_caching=False,
                                kv_cache_dtype=args.kv_cache_dtype).engine
    tokenizer = next(iter(engines.values())).tokenizer
    runners = {mode: loom_runner(engine) for mode, engine in engines.items()}
    rounds = []
    for r in range(args.rounds):
        prompt = c.prompt_token_ids(tokenizer, args.prompt, seed=r)
        rounds.append({mode: run_once(runner, prompt, args.tokens)
                       for mode, runner in runners.items()})
    a, b = names
    result = {
        "command": c.command_line(), "machine": c.machine_info(), "model": args.model,
        "modes": names, "env_b": args.env_b, "prompt": args.prompt, "tokens": args.tokens,
        "rounds": [{m: {"ttft_ms": round(t * 1e3), "decode_tok_s": round(d, 2)}
                    for m, (t, d) in rnd.items()} for rnd in rounds],
        "best": {m: {"ttft_ms": round(min(rnd[m][0] for rnd in rounds) * 1e3),
                     "decode_tok_s": round(max(rnd[m][1] for rnd in rounds), 2)}
                 for m in names},
        f"decode {b} / {a} per round": [round(rnd[b][1] / rnd[a][1], 3) for rnd in rounds],
        f"ttft {a} / {b} per round": [round(rnd[a][0] / rnd[b][0], 3) for rnd in rounds],
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
