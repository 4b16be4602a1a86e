"""First loads against the disk: Loom's first load of a GGUF beside two reads of the same file
from the disk, in rounds, so that all three meet the same host.

`bench_model_sizes.py` compares a first load with one cold read (`cat`) taken once before
it. On a virtual machine the time of a read through the page cache depends on how fast the
hypervisor backs the guest pages it lands in, which moves between minutes (measured on a
2-core EPYC guest: `cat` of a 6.6 GB file in 2.9-11.4 s within an hour), so one pair says
little. Here every round measures, in an order that turns between rounds, with the page
cache dropped before each:

- `cat`: the file read through once in 16 MiB reads (`bench_model_sizes.cold_read`);
- `direct`: the file read with O_DIRECT into two reused 64 MiB buffers, the disk's own
  speed with no page cache (where the file system allows O_DIRECT);
- `loom`: `loom.LLM(model=path)` in a fresh process with an empty prepared-weights cache
  (a temporary `LOOM_CACHE_DIR` whose other folders link to the real ones), its default
  mode; imports are not timed, and the prepared weights it writes are flushed before the
  next measurement.

Each round reports Loom's first load over both reads; the medians of the rounds' ratios are
the comparison. Needs root to drop the page cache (otherwise every read is from memory and
the round says so).

    python benchmarks/bench_first_load.py --gguf FILE.gguf [FILE.gguf ...] --rounds 4
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import common as c
from bench_model_sizes import (
    DEFAULT_CACHE_DIR,
    cold_read,
    drop_page_cache,
    empty_prepared_cache,
    run_child,
)

NAME = "first_load"
TITLE = "First loads against the disk (cat, O_DIRECT, Loom), in rounds"
DIRECT_CHUNK = 64 << 20


def direct_read(path: Path) -> dict[str, Any] | None:
    """The time to read `path` with O_DIRECT into two reused `DIRECT_CHUNK` buffers after
    the page cache is dropped; None where the file system refuses O_DIRECT."""
    dropped = drop_page_cache()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (AttributeError, OSError):
        return None
    buffers = [mmap.mmap(-1, DIRECT_CHUNK) for _ in range(2)]
    try:
        size, done, turn = os.fstat(fd).st_size, 0, 0
        start = c.now()
        while done < size:
            got = os.preadv(fd, [buffers[turn]], done)
            if got <= 0:
                break
            done += got
            turn ^= 1
        seconds = c.now() - start
    finally:
        os.close(fd)
    return {"s": round(seconds, 3), "gb_s": round(done / seconds / 1e9, 3),
            "page_cache_dropped": dropped}


def loom_first_load(path: Path, cache_parent: Path) -> dict[str, Any]:
    """`loom.LLM(model=path)` in a fresh process with an empty prepared cache, the page cache
    dropped first; the prepared file it writes is flushed before returning."""
    spec = {"path": str(path), "mode": "auto", "dtype": "auto", "device": "auto"}
    with empty_prepared_cache(cache_parent) as cache:
        env = {"LOOM_CACHE_DIR": str(cache), "LOOM_PREPARED_CACHE": "1"}
        dropped = drop_page_cache()
        got = run_child("load-loom", spec, env)
        os.sync()
    return {"s": got["load_s"], "peak_rss_gib": got["load_peak_rss_gib"],
            "resolved": got["resolved"], "page_cache_dropped": dropped}


def measure_file(path: Path, rounds: int, cache_parent: Path) -> dict[str, Any]:
    """`rounds` rounds of the three measurements, their order turning each round."""
    steps = {"cat": lambda: cold_read(path), "direct": lambda: direct_read(path),
             "loom": lambda: loom_first_load(path, cache_parent)}
    order = list(steps)
    out: list[dict[str, Any]] = []
    for r in range(rounds):
        turn = order[r % 3:] + order[:r % 3]
        row: dict[str, Any] = {"order": turn}
        for name in turn:
            row[name] = steps[name]()
        loom_s, direct = row["loom"]["s"], row["direct"]
        row["loom_over_cat"] = c.ratio(loom_s, row["cat"]["s"])
        row["loom_over_direct"] = c.ratio(loom_s, direct["s"]) if direct else None
        c.log(f"  round {r + 1} ({', '.join(turn)}): cat {row['cat']['s']:.2f} s, direct "
              f"{direct['s'] if direct else float('nan'):.2f} s, loom {loom_s:.2f} s: "
              f"{row['loom_over_cat']:.2f}x cat"
              + (f", {row['loom_over_direct']:.2f}x direct" if direct else ""))
        out.append(row)

    def median_of(key: str) -> float | None:
        values = [r[key] for r in out if r[key] is not None]
        return round(c.median(values), 3) if values else None

    return {"file_bytes": path.stat().st_size, "rounds": out,
            "median_loom_over_cat": median_of("loom_over_cat"),
            "median_loom_over_direct": median_of("loom_over_direct")}


def render(result: dict[str, Any]) -> str:
    rows = []
    for name, per_file in result["files"].items():
        for i, r in enumerate(per_file["rounds"], 1):
            direct = r["direct"]
            rows.append([name, i, " → ".join(r["order"]), r["cat"]["s"],
                         direct["s"] if direct else None, r["loom"]["s"],
                         r["loom"]["peak_rss_gib"], r["loom_over_cat"], r["loom_over_direct"]])
        rows.append([name, "median", "", None, None, None, None,
                     per_file["median_loom_over_cat"], per_file["median_loom_over_direct"]])
    table = c.markdown_table(
        ["file", "round", "order", "cat s", "O_DIRECT read s", "Loom first load s",
         "Loom peak RSS GiB", "Loom / cat", "Loom / O_DIRECT"], rows)
    return (table + "\n\nEach measurement starts with the page cache dropped. `cat`: the "
            "file read once in 16 MiB reads; O_DIRECT: read into two reused 64 MiB buffers "
            "(the disk's own speed, no page cache); Loom: `loom.LLM(model=path)` in a fresh "
            "process with an empty prepared-weights cache, its default mode, imports "
            "untimed, its prepared file flushed to disk before the next measurement. The "
            "order turns between rounds; the medians of the rounds' ratios are the "
            "comparison.")


def main() -> None:
    parser = c.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, nargs="+", required=True)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                        help="where the temporary prepared caches are made")
    args = parser.parse_args()
    if args.doc_only:
        return c.rerender(NAME, TITLE, render)
    args.model = ", ".join(path.name for path in args.gguf)  # what the doc's head names
    result = c.header(NAME, args, rounds=args.rounds, files={},
                      dtype="auto (the default mode)", sizes_note="the files named")
    for path in args.gguf:
        c.log(f"== {path.name}")
        result["files"][path.name] = measure_file(path, args.rounds, args.cache_dir)
    c.finish(NAME, TITLE, result, render, args.no_doc)


if __name__ == "__main__":
    main()
