"""KV connector: TTFT of a prompt whose K/V is loaded from a store, against computing it.

A producer engine (`SharedStorageConnector`, `kv_role="kv_producer"`) computes a
`--prompt-tokens` prompt once and saves its full KV blocks to a temporary folder. Then, in
one process on the same weights, with the prefix cache off on every measuring engine (so
only the store can supply K/V, and every repetition is a fresh request id):

- (a) TTFT of the prompt computed from scratch (an engine without a connector) against the
  same prompt on a consumer engine that loads its K/V from the store: one load step, then
  the last block's tokens are computed. Target: loading at least 5x faster than computing.
- (b) TTFT on a consumer whose connector (`GapConnector`, defined here) declares
  `--gap-tokens` of the matched blocks missing, so the engine recomputes them (segmented
  prefill) and loads the rest. Two layouts: the first N tokens ("prefix", one gap) and
  N tokens of blocks spread evenly over the prompt ("spread", N / block size gaps). A linear
  fit of TTFT against gap tokens gives the cost per gap token, to compare with the per-token
  cost of computing the whole prompt: the time follows the gap, not the prompt.

Every request generates `--output-tokens` greedy tokens (TTFT is the arrival of the first);
the tokens of every run are compared with those of the computed prompt. The store is on the
local disk and was just written, so loads read the page cache (the best case of a
`SharedStorageConnector`; a network file system or Redis adds its transfer time).

There is no peer row: neither transformers nor llama.cpp loads K/V from a shared store.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from typing import Any

import common as c

from loom.core.kv_transfer import blocks_to_ranges
from loom.core.request import Request
from loom.kv_connector import SharedStorageConnector

NAME = "kv_connector"
TITLE = "KV connector: TTFT with K/V loaded from a store, with and without gaps"
LAYOUTS = ("prefix", "spread")


class GapConnector(SharedStorageConnector):
    """A `SharedStorageConnector` that reports `gap_tokens` of each match as missing.

    `gap_layout` "prefix": the first blocks of the match; "spread": blocks spread evenly
    over it. The benchmark sets both attributes on the engine's scheduler-side instance
    (`engine.kv_connector`) before each request; the worker side only loads what the
    scheduler side queued, which skips the gap blocks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = self.config.kv_connector_extra_config
        self.gap_tokens = int(extra.get("gap_tokens", 0))
        self.gap_layout = str(extra.get("gap_layout", "prefix"))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The store's match, with this connector's gap blocks added to its gaps."""
        num, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        match = self._matches.get(request.request_id)
        if match is None or not num or self.gap_tokens <= 0:
            return num, is_async
        size = self.spec.block_size
        first = num_computed_tokens // size
        gaps = gap_blocks(first, first + num // size, self.gap_tokens // size, self.gap_layout)
        missing = {i for a, b in match.gaps for i in range(a // size, b // size)} | set(gaps)
        match.gaps = blocks_to_ranges(sorted(missing), size)
        return num, is_async


def gap_blocks(first: int, end: int, count: int, layout: str) -> list[int]:
    """`count` table indices in [first, end): the first ones ("prefix") or evenly spread."""
    span = end - first
    count = min(count, span)
    if count <= 0:
        return []
    if layout == "prefix":
        return list(range(first, first + count))
    if layout == "spread":
        return [first + (2 * k + 1) * span // (2 * count) for k in range(count)]
    raise ValueError(f"unknown gap layout {layout!r}; choose one of {LAYOUTS}")


def kv_config(role: str, folder: str, connector: str = "SharedStorageConnector") -> Any:
    """The engine's `kv_transfer_config`: a built-in connector, or this module's
    `GapConnector` (found by module name, which is `__main__` when run as a script)."""
    from loom.kv_connector import KVTransferConfig

    return KVTransferConfig(
        connector, kv_role=role, kv_connector_extra_config={"shared_storage_path": folder},
        kv_connector_module_path=None if connector == "SharedStorageConnector" else __name__,
    )


def run_request(engine: Any, rid: str, ids: list[int], output_tokens: int) -> dict[str, Any]:
    """Generate `output_tokens` greedy tokens: TTFT (add_request to the first token), the
    steps until it and how many of them loaded K/V, the tokens, and the stats it moved."""
    from loom import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    before = engine.stats
    ttft = None
    steps = load_steps = 0
    load_step_s = 0.0
    tokens: list[int] = []
    start = c.now()
    engine.add_request(rid, ids, params)
    while engine.has_unfinished_requests():
        step_start = c.now()
        outputs = engine.step()
        if ttft is None:
            steps += 1
            sched = engine.last_scheduler_output
            if sched is not None and rid in sched.loading_request_ids:
                load_steps += 1
                load_step_s += c.now() - step_start
        for out in outputs:
            if out.request_id == rid and out.outputs[0].token_ids:
                if ttft is None:
                    ttft = c.now() - start
                tokens = list(out.outputs[0].token_ids)
    after = engine.stats
    assert ttft is not None, f"request {rid} produced no token"
    return {
        "ttft_ms": ttft * 1e3,
        "steps_to_first_token": steps,
        "load_steps": load_steps,
        "load_step_ms": load_step_s * 1e3,
        "tokens": tokens,
        "kv_loaded_tokens": after.kv_loaded_tokens - before.kv_loaded_tokens,
        "kv_gap_tokens": after.kv_gap_tokens - before.kv_gap_tokens,
        "kv_load_failed_tokens": after.kv_load_failed_tokens - before.kv_load_failed_tokens,
    }


def summarize(runs: list[dict[str, Any]], reference: list[int]) -> dict[str, Any]:
    """Median TTFT of the runs, every TTFT, the counters (equal across runs) and whether
    every run's tokens equal the reference (the computed prompt's)."""
    first = runs[0]
    return {
        "ttft_ms": round(c.median([r["ttft_ms"] for r in runs]), 2),
        "ttft_ms_all": [round(r["ttft_ms"], 2) for r in runs],
        "steps_to_first_token": first["steps_to_first_token"],
        "load_steps": first["load_steps"],
        "load_step_ms": round(c.median([r["load_step_ms"] for r in runs]), 2),
        "kv_loaded_tokens": first["kv_loaded_tokens"],
        "kv_gap_tokens": first["kv_gap_tokens"],
        "kv_load_failed_tokens": first["kv_load_failed_tokens"],
        "counters_equal_across_runs": all(
            r[k] == first[k] for r in runs
            for k in ("kv_loaded_tokens", "kv_gap_tokens", "kv_load_failed_tokens")
        ),
        "tokens": first["tokens"],
        "tokens_equal_computed": all(r["tokens"] == reference for r in runs),
    }


def linear_fit(xs: list[float], ys: list[float]) -> dict[str, float | None]:
    """Least squares y = intercept + slope * x, and R^2."""
    n = len(xs)
    if n < 2:
        return {"slope": None, "intercept": None, "r2": None}
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx if sxx else 0.0
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return {"slope": slope, "intercept": intercept,
            "r2": 1 - ss_res / ss_tot if ss_tot else None}


def num_blocks_for(args: Any) -> int:
    """A KV pool that holds one request (no preemption), and a little more."""
    return (args.prompt_tokens + args.output_tokens) // 16 + 16


def measure(args: Any, producer: Any, prompt: list[int], warm: list[int],
            folder: str) -> dict[str, Any]:
    """Save the prompt's K/V with the producer, then time compute, load and gaps in turns
    (compute, load, each gap size; repeated) so a slow stretch of a shared host hits all."""
    common = {"num_kv_blocks": num_blocks_for(args)}
    produced = run_request(producer, "produce", prompt, args.output_tokens)
    saved = producer.stats.kv_saved_blocks
    c.log(f"producer: saved {saved} blocks, TTFT {produced['ttft_ms']:.0f} ms")

    engines = {
        "compute": c.make_engine(args, **common, enable_prefix_caching=False),
        "load": c.make_engine(args, **common, enable_prefix_caching=False,
                              kv_transfer_config=kv_config("kv_consumer", folder)),
        "gaps": c.make_engine(args, **common, enable_prefix_caching=False,
                              kv_transfer_config=kv_config("kv_consumer", folder,
                                                           "GapConnector")),
    }
    gap_connector = engines["gaps"].kv_connector
    assert isinstance(gap_connector, GapConnector), type(gap_connector)
    for name, engine in engines.items():  # first forwards and the first load, untimed
        run_request(engine, f"warm-{name}", warm, 2)
    run_request(engines["load"], "warm-load", prompt, 2)

    runs: dict[str, list[dict[str, Any]]] = {"compute": [], "load": []}
    gap_runs: dict[str, dict[int, list[dict[str, Any]]]] = {
        layout: {n: [] for n in args.gap_tokens} for layout in args.gap_layouts}
    for r in range(args.repeats):
        for name in ("compute", "load"):
            runs[name].append(run_request(engines[name], f"{name}-{r}", prompt,
                                          args.output_tokens))
        for layout in args.gap_layouts:
            for n in args.gap_tokens:
                gap_connector.gap_tokens, gap_connector.gap_layout = n, layout
                gap_runs[layout][n].append(run_request(
                    engines["gaps"], f"gap-{layout}-{n}-{r}", prompt, args.output_tokens))
        c.log(f"repeat {r + 1}/{args.repeats}: compute {runs['compute'][-1]['ttft_ms']:.0f} ms, "
              f"load {runs['load'][-1]['ttft_ms']:.0f} ms, gaps "
              + "; ".join(f"{layout} " + " ".join(
                  f"{n}:{gap_runs[layout][n][-1]['ttft_ms']:.0f}" for n in args.gap_tokens)
                  for layout in args.gap_layouts))
    for name, engine in engines.items():
        assert engine.kv_pool_all_free, f"the benchmark leaked KV blocks ({name})"

    reference = runs["compute"][0]["tokens"]
    results: dict[str, Any] = {
        "producer": {"saved_blocks": saved, "ttft_ms": round(produced["ttft_ms"], 2),
                     "tokens_equal_computed": produced["tokens"] == reference},
        "compute": summarize(runs["compute"], reference),
        "load": summarize(runs["load"], reference),
        "gaps": {layout: {str(n): summarize(gap_runs[layout][n], reference)
                          for n in args.gap_tokens} for layout in args.gap_layouts},
    }
    return results


def summary_of(args: Any, results: dict[str, Any]) -> dict[str, Any]:
    """The ratios: compute over load, and per layout the fit of TTFT against gap tokens."""
    compute, load = results["compute"], results["load"]
    per_token = compute["ttft_ms"] / args.prompt_tokens
    out: dict[str, Any] = {
        "compute_ttft_ms": compute["ttft_ms"],
        "load_ttft_ms": load["ttft_ms"],
        "load_step_ms": load["load_step_ms"],
        "compute_over_load": c.ratio(compute["ttft_ms"], load["ttft_ms"]),
        "target_compute_over_load": 5.0,
        "target_met": (c.ratio(compute["ttft_ms"], load["ttft_ms"]) or 0) >= 5.0,
        "load_proved": load["kv_loaded_tokens"] > 0 and load["load_steps"] == 1
        and load["counters_equal_across_runs"],
        "compute_ms_per_prompt_token": round(per_token, 4),
        "tokens_equal_everywhere": all(
            [results["producer"]["tokens_equal_computed"], compute["tokens_equal_computed"],
             load["tokens_equal_computed"]]
            + [g["tokens_equal_computed"] for layout in results["gaps"].values()
               for g in layout.values()]),
        "gap_fits": {},
    }
    for layout, per_gap in results["gaps"].items():
        xs = [float(n) for n in per_gap]
        ys = [g["ttft_ms"] for g in per_gap.values()]
        fit = linear_fit(xs, ys)
        largest = per_gap[str(max(args.gap_tokens))]
        out["gap_fits"][layout] = {
            "ms_per_gap_token": None if fit["slope"] is None else round(fit["slope"], 4),
            "intercept_ms": None if fit["intercept"] is None else round(fit["intercept"], 2),
            "r2": None if fit["r2"] is None else round(fit["r2"], 4),
            "gap_token_over_prompt_token_cost": c.ratio(fit["slope"], per_token),
            "monotonic": all(a <= b for a, b in itertools.pairwise(ys)),
            "largest_gap_tokens": max(args.gap_tokens),
            "largest_gap_ttft_over_compute": c.ratio(largest["ttft_ms"], compute["ttft_ms"]),
            "largest_gap_fraction_of_prompt": round(max(args.gap_tokens) / args.prompt_tokens,
                                                    4),
        }
    return out


def main() -> None:
    """Parse arguments, save the prompt with a producer, measure, report."""
    parser = c.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="default 2048 (quick 512)")
    parser.add_argument("--gap-tokens", type=int, nargs="+", default=None,
                        help="gap sizes, multiples of 16 (default 0 128 256 512 1024; quick "
                             "0 64 128 256)")
    parser.add_argument("--gap-layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--output-tokens", type=int, default=8,
                        help="greedy tokens per request (compared across runs)")
    parser.add_argument("--store", default=None,
                        help="store folder (default: a temporary folder, removed at the end)")
    args = parser.parse_args()
    if args.doc_only:
        return c.rerender(NAME, TITLE, render)
    args.prompt_tokens = args.prompt_tokens or (512 if args.quick else 2048)
    args.gap_tokens = sorted(set(args.gap_tokens or ([0, 64, 128, 256] if args.quick
                                                     else [0, 128, 256, 512, 1024])))
    args.repeats = args.repeats or (2 if args.quick else 3)
    if any(n % 16 or n < 0 or n >= args.prompt_tokens for n in args.gap_tokens):
        parser.error("--gap-tokens must be multiples of 16 below --prompt-tokens")

    folder = args.store or tempfile.mkdtemp(prefix="loom-bench-kv-")
    try:
        producer = c.make_engine(args, num_kv_blocks=num_blocks_for(args),
                                 kv_transfer_config=kv_config("kv_producer", folder))
        tok, dtype = producer.tokenizer, producer.config.dtype
        prompt = c.prompt_token_ids(tok, args.prompt_tokens, seed=7)
        warm = c.prompt_token_ids(tok, 64, seed=99)
        results = measure(args, producer, prompt, warm, folder)
        del producer
    finally:
        if args.store is None:
            shutil.rmtree(folder, ignore_errors=True)

    summary = summary_of(args, results)
    sizes = (f"{args.prompt_tokens}-token prompt, {args.output_tokens} greedy output tokens; "
             f"gaps {args.gap_tokens} tokens ({', '.join(args.gap_layouts)}); "
             f"TTFT median of {args.repeats}; store: SharedStorageConnector on local disk "
             f"(page cache)")
    config = {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
              "gap_tokens": args.gap_tokens, "gap_layouts": args.gap_layouts,
              "repeats": args.repeats, "block_size": 16, "enable_prefix_caching": False,
              "max_num_batched_tokens": 512, "store": "temporary folder"
              if args.store is None else args.store}
    result = c.header(NAME, args, dtype=dtype, sizes_note=sizes, config=config,
                      results=results, summary=summary, skipped=[])
    path = c.RESULTS_DIR / f"{NAME}.json"
    c.finish(NAME, TITLE, result, render, args.no_doc)
    c.log(human_summary(result) + f"\nJSON: {path.relative_to(c.ROOT)}")


def human_summary(result: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    s, res = result["summary"], result["results"]
    lines = [
        f"TTFT {result['config']['prompt_tokens']} tokens: computed {c.fmt(s['compute_ttft_ms'])}"
        f" ms, loaded {c.fmt(s['load_ttft_ms'])} ms ({res['load']['kv_loaded_tokens']} tokens "
        f"loaded in {res['load']['load_steps']} step of {c.fmt(s['load_step_ms'])} ms) -> "
        f"{c.fmt(s['compute_over_load'])}x "
        f"(target >= 5x: {'met' if s['target_met'] else 'NOT met'})",
        f"compute cost {c.fmt(s['compute_ms_per_prompt_token'], 3)} ms per prompt token; "
        f"tokens equal everywhere: {s['tokens_equal_everywhere']}",
    ]
    for layout, fit in s["gap_fits"].items():
        per = res["gaps"][layout]
        lines.append(
            f"gaps {layout}: " + ", ".join(f"{n}: {c.fmt(g['ttft_ms'], 0)} ms"
                                           for n, g in per.items())
            + f" -> {c.fmt(fit['ms_per_gap_token'], 3)} ms per gap token "
            f"({c.fmt(fit['gap_token_over_prompt_token_cost'])}x a prompt token, "
            f"R^2 {c.fmt(fit['r2'], 3)})")
    return "\n".join(lines)


def render(result: dict[str, Any]) -> str:
    """The doc section's body: compute vs load, then TTFT per gap size and layout."""
    res, s = result["results"], result["summary"]
    rows = [["computed (no connector)", res["compute"]["ttft_ms"], 0, 0,
             res["compute"]["steps_to_first_token"], res["compute"]["tokens_equal_computed"]],
            ["loaded (SharedStorageConnector)", res["load"]["ttft_ms"],
             res["load"]["kv_loaded_tokens"], res["load"]["kv_gap_tokens"],
             res["load"]["steps_to_first_token"], res["load"]["tokens_equal_computed"]]]
    for layout, per in res["gaps"].items():
        rows += [[f"gaps {layout}, {n} tokens", g["ttft_ms"], g["kv_loaded_tokens"],
                  g["kv_gap_tokens"], g["steps_to_first_token"], g["tokens_equal_computed"]]
                 for n, g in per.items()]
    table = c.markdown_table(["run", "TTFT ms", "tokens loaded", "tokens recomputed (gaps)",
                              "steps to first token", "tokens = computed"], rows)
    fits = "; ".join(
        f"{layout}: {c.fmt(f['ms_per_gap_token'], 3)} ms per gap token "
        f"({c.fmt(f['gap_token_over_prompt_token_cost'])}x a prompt token's "
        f"{c.fmt(s['compute_ms_per_prompt_token'], 3)} ms, R² {c.fmt(f['r2'], 3)})"
        for layout, f in s["gap_fits"].items())
    return (f"{table}\n\nLoading the prompt's K/V is {c.fmt(s['compute_over_load'])}x faster "
            f"than computing it (target at least 5x). With gaps the TTFT grows with the gap "
            f"tokens: {fits}.")


if __name__ == "__main__":
    main()
