"""PNG plots of the JSON results in benchmarks/results/ into docs/ (needs matplotlib).

    python benchmarks/plot.py            # every result that exists
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import common as c

DOCS = c.ROOT / "docs"


def _load(name: str) -> dict[str, Any] | None:
    path = c.RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _subtitle(result: dict[str, Any]) -> str:
    m = result["machine"]
    return f"{result['model']}, {m['cores']} cores {m['cpu']}, {result['date'][:10]}"


def plot_latency(plt: Any, result: dict[str, Any]) -> Path:
    """Bars of TTFT and decode tokens/s per engine and prompt length."""
    engines = list(result["results"])
    lens = [str(n) for n in result["prompt_lens"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(engines))
    for i, engine in enumerate(engines):
        xs = [j + i * width for j in range(len(lens))]
        per = result["results"][engine]
        axes[0].bar(xs, [per[n]["ttft_ms"] for n in lens], width, label=engine)
        axes[1].bar(xs, [per[n]["decode_tok_s"] for n in lens], width, label=engine)
    for ax, title in zip(axes, ["time to first token (ms, lower is better)",
                                "decode tokens/s (higher is better)"], strict=True):
        ax.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(lens))])
        ax.set_xticklabels([f"{n} prompt tokens" for n in lens])
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8, loc="upper left")  # the short 512-token bars leave room there
    fig.suptitle(f"Latency — {_subtitle(result)}", fontsize=10)
    return _save(plt, fig, "bench_latency.png")


def plot_throughput(plt: Any, result: dict[str, Any]) -> Path:
    """Horizontal bars of output and total tokens/s per engine."""
    engines = list(result["results"])
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(engines) + 1.5))
    ys = range(len(engines))
    ax.barh([y + 0.2 for y in ys], [result["results"][e]["total_tok_s"] for e in engines],
            0.4, label="total tok/s")
    ax.barh([y - 0.2 for y in ys], [result["results"][e]["output_tok_s"] for e in engines],
            0.4, label="output tok/s")
    ax.set_yticks(list(ys))
    ax.set_yticklabels(engines, fontsize=8)
    ax.legend(fontsize=8)
    ax.set_title(f"Offline throughput ({result['sizes_note']})\n{_subtitle(result)}",
                 fontsize=9)
    return _save(plt, fig, "bench_throughput.png")


def plot_sessions(plt: Any, result: dict[str, Any]) -> Path:
    """Append time against context length: live, re-submit, HF cache, llama.cpp."""
    res = result["results"]
    ctx = [str(n) for n in result["contexts"]]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    series = [
        (f"Loom {result.get('dtype', '')} live append", res["loom"], "live_ms"),
        (f"Loom {result.get('dtype', '')} re-submit (no cache)", res["loom"], "resubmit_ms"),
        (f"Loom {result.get('dtype', '')} re-submit (prefix cache hit)", res["loom"],
         "resubmit_cached_ms"),
        *[(f"{k} live append", v, "live_ms") for k, v in res.items()
          if k.startswith("loom ")],
        ("HF DynamicCache append", res.get("transformers"), "append_ms"),
        ("llama.cpp append", res.get("llama.cpp"), "append_ms"),
    ]
    for label, data, key in series:
        if not data:
            continue
        pts = [(int(n), data[n][key]) for n in ctx if data.get(n, {}).get(key) is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"time to append {result['append_tokens']} tokens (ms)")
    ax.legend(fontsize=8)
    ax.set_title(f"Live appends — {_subtitle(result)}", fontsize=10)
    return _save(plt, fig, "bench_sessions.png")


def plot_hooks(plt: Any, result: dict[str, Any]) -> Path:
    """Time and peak KV blocks: hook against separate requests."""
    res = result["results"]
    labels = ["promise/sync", "separate"]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    axes[0].bar(labels, [res["hook"]["time_s"], res["separate"]["time_s"]], color="C0")
    axes[0].set_title("wall time (s)", fontsize=10)
    axes[1].bar(labels, [res["hook"]["peak_blocks"], res["separate"]["peak_blocks"]],
                color="C1")
    axes[1].set_title("peak KV blocks", fontsize=10)
    fig.suptitle(f"Fan-out ({result['sizes_note']})\n{_subtitle(result)}", fontsize=9)
    return _save(plt, fig, "bench_hooks.png")


def _save(plt: Any, fig: Any, name: str) -> Path:
    fig.tight_layout()
    path = DOCS / name
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


PLOTS = {"latency": plot_latency, "throughput": plot_throughput,
         "sessions": plot_sessions, "hooks": plot_hooks}


def main() -> int:
    """Plot every benchmark whose result exists."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        c.log("plot: skipped (matplotlib not installed; pip install matplotlib)")
        return 0
    for name, fn in PLOTS.items():
        result = _load(name)
        if result is None:
            c.log(f"plot {name}: no results yet (run benchmarks/bench_{name}.py)")
            continue
        c.log(f"plot {name}: {fn(plt, result).relative_to(c.ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
