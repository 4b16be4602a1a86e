"""Model sizes: Loom against llama.cpp on 0.36-8B GGUFs, decode, TTFT, loads, memory, bandwidth.

Models people run on a CPU are 1-8B GGUFs. For each size a random-weight GGUF of the real
shape with Q4_K_M's block mix (`benchmarks/random_gguf.py`; speed and memory do not depend on
the values, so EOS is ignored) is written once into `--cache-dir` and reused. Per size:

- Loom, for each `--loom-modes` entry ("auto" = the engine's default; see
  `common.loom_mode_kwargs`): a first load in a fresh process with an empty prepared-weights
  cache, then a warm load in another fresh process on the now filled cache, which then
  measures TTFT of a `--prompt-len` prompt and greedy decode tok/s (`bench_latency.measure`:
  medians over `--repeats` distinct prompts). Each load reports its time and the process's
  peak RSS (VmHWM, every byte ever resident); "prepared" is the size of the cache
  file(s) the first load wrote. The empty cache is a temporary `LOOM_CACHE_DIR` whose
  `prepared/` is new and whose other folders (kernels, tokenizers, verified) link to the
  real ones, so only the weights are prepared again; the user's cache is not touched.
- llama.cpp (`llama-cpp-python`) on the same file in a fresh process: load time and peak RSS,
  then the same TTFT and decode measurement.
- The read-bandwidth limit: the bandwidth of `torch.ones(N).sum()` over 512 MiB with
  `--threads` threads (best of 5, measured once per run) divided by the bytes a decode step
  reads per token gives a tok/s limit; the table reports decode tok/s as a share of it. Bytes
  per token: for llama.cpp the GGUF's tensor bytes, for Loom the prepared tensors (in both,
  the input embedding is left out when the output head is stored separately).

Sizes: smollm2-360m, smollm2-1.7b and llama-3b by default; llama-8b only when `--sizes` names
it, or with `--with-8b` when at least 20 GB of memory is available (else it is listed as
skipped). `--sizes` also takes paths of real GGUF files. `--model` and `--quantization` of the
common flags are not used here (`--sizes` and `--loom-modes` choose).

    python benchmarks/bench_model_sizes.py                     # 360M, 1.7B, 3B
    python benchmarks/bench_model_sizes.py --with-8b           # and 8B when memory allows
    python benchmarks/bench_model_sizes.py --sizes smollm2-1.7b --loom-modes auto w4a8 w8a8
    python benchmarks/bench_model_sizes.py --quick --no-doc    # 360M only, 16 tokens
    python benchmarks/bench_model_sizes.py --doc-only          # re-render the doc section
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bench_latency as bl
import common as c
from random_gguf import SHAPES, llama_quantize, write_random_gguf

NAME = "model_sizes"
TITLE = "Model sizes: Loom against llama.cpp on 0.36-8B Q4_K_M GGUFs"
DEFAULT_SIZES = ["smollm2-360m", "smollm2-1.7b", "llama-3b"]
QUICK_SIZES = ["smollm2-360m"]
BIG_SIZE = "llama-8b"
BIG_MIN_AVAILABLE_GB = 20.0  # --with-8b runs the 8B only with this much memory available
GGUF_TYPE = "q4_k_m"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "loom" / "bench-models"
# Folders of Loom's cache the temporary one links to (everything but the prepared weights).
SHARED_CACHE_FOLDERS = ("kernels", "tokenizers", "verified")
BANDWIDTH_MIB = 512
GIB = 2**30


# ---- the model files -----------------------------------------------------------------


def model_file(size: str, cache_dir: Path) -> Path:
    """The GGUF of `size`: a path as given, or the random file of that shape in `cache_dir`
    (written once, atomically, and reused)."""
    if size not in SHAPES:
        path = Path(size).expanduser()
        if not path.is_file():
            raise SystemExit(f"--sizes: {size!r} is neither a shape {sorted(SHAPES)} nor a file")
        return path
    path = cache_dir / f"{size}-{GGUF_TYPE}.gguf"
    if path.is_file():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[size]
    c.log(f"{size}: writing {path} (random weights, {how_written(size)}) ...")
    if not needs_quantiser(size):
        partial = path.with_name(path.name + ".partial")
        try:
            write_random_gguf(partial, shape, GGUF_TYPE, log=c.log)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        return path
    f16 = cache_dir / f"{size}-f16-tmp.gguf"
    quantised = f16.with_name(f"{f16.stem}.Q4_K_M.gguf")  # where llama_quantize writes
    try:
        write_random_gguf(f16, shape, "f16", log=c.log)
        start = c.now()
        log = cache_dir / f"{size}-quantize.log"
        with stderr_to(log):  # llama.cpp prints a line per tensor
            target = llama_quantize(f16, "Q4_K_M")
        os.replace(target, path)
        log.unlink()
        c.log(f"{size}: quantised by llama.cpp in {c.now() - start:.0f} s")
    finally:
        f16.unlink(missing_ok=True)
        quantised.unlink(missing_ok=True)
    return path


@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """Send this process's stderr (file descriptor 2, which C libraries write to) to `path`
    for the duration of a block; says where it went should the block fail."""
    sys.stderr.flush()
    saved = os.dup(2)
    done = False
    try:
        with path.open("w") as f:
            os.dup2(f.fileno(), 2)
            yield
        done = True
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if not done:
            c.log(f"(llama.cpp's output: {path})")


def needs_quantiser(size: str) -> bool:
    """Whether a shape has matrices whose rows are not whole 256-wide K-quant blocks (the
    360M's hidden size is 960): random_gguf.py cannot write those in Q4_K_M's blocks, so the
    file is a random F16 one quantised by llama.cpp's own Q4_K_M (with its fallback types)."""
    shape = SHAPES[size]
    return shape.hidden % 256 != 0 or shape.ffn % 256 != 0


def how_written(size: str) -> str:
    """How a size's file is made, for the log and the result."""
    if size not in SHAPES:
        return "the file as given"
    if needs_quantiser(size):
        return ("random F16 quantised by llama.cpp's Q4_K_M (its fallback types where rows "
                "are not whole 256-wide blocks)")
    return "random Q4_K / Q6_K blocks in Q4_K_M's mix (random_gguf.py)"


def size_label(size: str) -> str:
    """A size's name in the table: the shape's name, or a file's stem."""
    return size if size in SHAPES else Path(size).stem


def gguf_read_bytes(path: Path) -> tuple[int, int]:
    """(all tensor bytes, bytes a decode step reads: all but the input embedding when the
    file has a separate output head) of a GGUF file."""
    from loom.loader.gguf_reader import GGUFFile

    tensors = GGUFFile(path).tensors
    total = sum(t.nbytes for t in tensors)
    separate_head = any(t.name == "output.weight" for t in tensors)
    embedding = sum(t.nbytes for t in tensors if t.name == "token_embd.weight")
    return total, total - embedding if separate_head else total


def prepared_read_bytes(files: list[Path]) -> int:
    """Bytes of the tensors in Loom's prepared safetensors file(s) a decode step reads: all
    but the input embedding when the output head is stored on its own (a tied head aliases
    the embedding and is not stored twice)."""
    total = 0
    for path in files:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        separate_head = any(name.startswith("lm_head.") for name in header)
        for name, info in header.items():
            if separate_head and name.startswith("model.embed_tokens."):
                continue
            start, end = info["data_offsets"]
            total += end - start
    return total


# ---- machine ---------------------------------------------------------------------------


def available_memory_gb() -> float:
    """Memory available to new processes, GB (psutil, else /proc/meminfo's MemAvailable)."""
    try:
        import psutil

        return psutil.virtual_memory().available / 1e9
    except ImportError:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / 1e9
    return 0.0


def read_bandwidth(threads: int, mib: int = BANDWIDTH_MIB, repeats: int = 5) -> dict[str, Any]:
    """Read bandwidth of `torch.ones(N).sum()` over `mib` MiB with `threads` threads: the
    best of `repeats` timed sums (the tensor is allocated and touched once, untimed)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        values = torch.ones(mib * 2**20 // 4)
        values.sum()
        times = []
        for _ in range(repeats):
            start = c.now()
            values.sum()
            times.append(c.now() - start)
        nbytes = values.nbytes
        del values
    finally:
        torch.set_num_threads(previous)
    return {"gb_s": round(nbytes / min(times) / 1e9, 3), "mib": mib, "threads": threads,
            "times_s": [round(t, 5) for t in times]}


def peak_rss_gib() -> float:
    """This process's peak resident memory so far, GiB: /proc/self/status's VmHWM, the
    high-water mark of this process's own memory. (`ru_maxrss` is the fallback only: Linux
    carries the parent's high-water mark into a child spawned by vfork + exec, so a child of
    this script, whose bandwidth probe touched 512 MiB, would report at least that.)"""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 2**20, 3)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)


# ---- the child processes ----------------------------------------------------------------


def _child_measure(run: bl.Runner, spec: dict[str, Any]) -> dict[str, Any]:
    """TTFT and decode of `run` on the spec's prompts (`bench_latency.measure`)."""
    work = spec["run"]
    measured = bl.measure(run, work["prompts"], work["warmup"], work["max_tokens"])
    return {**measured, "run_peak_rss_gib": peak_rss_gib()}


def child_load_loom(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the model with `loom.LLM` (imports untimed), then optionally measure it."""
    import loom
    import loom.engine.llm  # torch and the engine modules: not part of the load

    start = c.now()
    llm = loom.LLM(model=spec["path"], dtype=spec["dtype"], device=spec["device"],
                   **c.loom_mode_kwargs(spec["mode"]))
    out: dict[str, Any] = {"load_s": round(c.now() - start, 3),
                           "load_peak_rss_gib": peak_rss_gib(),
                           "resolved": c.engine_label(llm.engine.config),
                           "dtype": llm.engine.config.dtype,
                           "mode_summary": llm.engine.config.mode_summary}
    if spec.get("run"):
        out.update(_child_measure(bl.loom_runner(llm.engine), spec))
    return out


def child_load_llama_cpp(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the file with llama.cpp (import untimed), then measure it."""
    import llama_cpp  # noqa: F401

    start = c.now()
    llm = c.load_llama_cpp(spec["path"], spec["n_ctx"], spec["threads"])
    if llm is None:
        raise SystemExit("llama.cpp could not load the file (see above)")
    out = {"load_s": round(c.now() - start, 3), "load_peak_rss_gib": peak_rss_gib()}
    if spec.get("run"):
        out.update(_child_measure(bl.llama_cpp_runner(llm), spec))
    return out


CHILDREN = {"load-loom": child_load_loom, "load-llama": child_load_llama_cpp}


def child_main(kind: str) -> None:
    """The hidden `--child KIND` entry: read the spec (JSON) from stdin, print one result."""
    out = CHILDREN[kind](json.loads(sys.stdin.read()))
    print(c.RESULT_PREFIX + json.dumps(out), flush=True)


def run_child(kind: str, spec: dict[str, Any], env: dict[str, str] | None = None,
              ) -> dict[str, Any]:
    """Run this script as `--child KIND` in a fresh process; its result, plus the wall time
    from launch to exit (RuntimeError with the tail of its stderr when it fails)."""
    result = c.run_result_child(
        [sys.executable, str(Path(__file__).resolve()), "--child", kind],
        stdin=json.dumps(spec), env=env)
    result["process_s"] = round(result["process_s"], 3)
    return result


@contextlib.contextmanager
def empty_prepared_cache(parent: Path) -> Iterator[Path]:
    """A temporary `LOOM_CACHE_DIR` (under `parent`) whose `prepared/` starts empty and whose
    other folders link to the real cache's; removed afterwards (links first, never
    followed)."""
    from loom.cache_dir import loom_cache_dir

    real = loom_cache_dir("prepared").parent
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="loom-cache-", dir=parent))
    try:
        for name in SHARED_CACHE_FOLDERS:
            (real / name).mkdir(parents=True, exist_ok=True)
            (root / name).symlink_to(real / name, target_is_directory=True)
        (root / "prepared").mkdir()
        yield root
    finally:
        for name in SHARED_CACHE_FOLDERS:
            if (root / name).is_symlink():
                (root / name).unlink()
        shutil.rmtree(root, ignore_errors=True)


# ---- one size --------------------------------------------------------------------------


def loom_mode_row(args: argparse.Namespace, path: Path, mode: str,
                  work: dict[str, Any], threads_env: dict[str, str]) -> dict[str, Any]:
    """First load (empty prepared cache), warm load plus TTFT/decode, prepared bytes."""
    spec = {"path": str(path), "mode": mode, "dtype": args.dtype, "device": args.device}
    with empty_prepared_cache(args.cache_dir) as cache:
        env = {**threads_env, "LOOM_CACHE_DIR": str(cache), "LOOM_PREPARED_CACHE": "1"}
        c.log(f"  loom {mode}: first load (empty prepared cache) ...")
        first = run_child("load-loom", spec, env)
        files = sorted(p for p in (cache / "prepared").rglob("*") if p.is_file())
        prepared = sum(p.stat().st_size for p in files)
        read = prepared_read_bytes([p for p in files if p.suffix == ".safetensors"])
        c.log(f"  loom {mode}: first load {first['load_s']:.2f} s, peak "
              f"{first['load_peak_rss_gib']:.2f} GiB, prepared {prepared / GIB:.2f} GiB; "
              "warm load and measurement ...")
        warm = run_child("load-loom", {**spec, "run": work}, env)
    c.log(f"  {loom_label(mode, warm['resolved'])}: warm load {warm['load_s']:.2f} s, TTFT "
          f"{warm['ttft_ms']:.0f} ms, decode {warm['decode_tok_s']:.2f} tok/s")
    return {
        "engine": "loom", "mode": mode, "resolved": warm["resolved"], "dtype": warm["dtype"],
        "mode_summary": warm["mode_summary"],
        "first_load_s": first["load_s"], "first_load_rss_gib": first["load_peak_rss_gib"],
        "first_process_s": first["process_s"],
        "warm_load_s": warm["load_s"], "warm_load_rss_gib": warm["load_peak_rss_gib"],
        "prepared_bytes": prepared, "prepared_files": [p.name for p in files],
        "read_bytes_per_token": read, "read_bytes_source": "prepared tensors",
        **_run_part(warm),
    }


def llama_cpp_row(args: argparse.Namespace, path: Path, work: dict[str, Any],
                  read_bytes: int) -> dict[str, Any]:
    """llama.cpp's load (time, peak RSS) and TTFT/decode in one fresh process."""
    n_ctx = work["prompt_len"] + work["max_tokens"] + 64
    spec = {"path": str(path), "n_ctx": n_ctx, "threads": args.threads, "run": work}
    c.log("  llama.cpp: load and measurement ...")
    got = run_child("load-llama", spec)
    c.log(f"  llama.cpp: load {got['load_s']:.2f} s, TTFT {got['ttft_ms']:.0f} ms, decode "
          f"{got['decode_tok_s']:.2f} tok/s")
    return {
        "engine": "llama.cpp", "first_load_s": got["load_s"],
        "first_load_rss_gib": got["load_peak_rss_gib"], "first_process_s": got["process_s"],
        "read_bytes_per_token": read_bytes, "read_bytes_source": "GGUF tensor bytes",
        **_run_part(got),
    }


def loom_label(mode: str, resolved: str) -> str:
    """A Loom row's name: the mode asked for, and what it resolved to where that differs."""
    return f"loom {mode}" if resolved == mode else f"loom {mode} ({resolved})"


def _run_part(got: dict[str, Any]) -> dict[str, Any]:
    keys = ("ttft_ms", "decode_tok_s", "ttft_ms_all", "decode_tok_s_all", "run_peak_rss_gib")
    return {k: got[k] for k in keys}


def add_limits(rows: dict[str, dict[str, Any]], bandwidth_gb_s: float) -> None:
    """Each row's tok/s limit (bandwidth / bytes per token), its decode share of it, and the
    Loom rows' ratios to llama.cpp."""
    peer = rows.get("llama.cpp")
    for label, row in rows.items():
        limit = c.ratio(bandwidth_gb_s * 1e9, row["read_bytes_per_token"])  # None: no bytes
        row["limit_tok_s"] = limit
        row["decode_share_of_limit"] = c.ratio(row["decode_tok_s"], limit)
        if peer is not None and label != "llama.cpp":
            row["decode_over_llama_cpp"] = c.ratio(row["decode_tok_s"], peer["decode_tok_s"])
            row["ttft_over_llama_cpp"] = c.ratio(row["ttft_ms"], peer["ttft_ms"])


def measure_size(args: argparse.Namespace, size: str, work_sizes: dict[str, Any],
                 bandwidth_gb_s: float) -> dict[str, Any]:
    """Every engine on one size's file."""
    from loom.tokenizer.loader import load_tokenizer

    path = model_file(size, args.cache_dir)
    total, read = gguf_read_bytes(path)
    # Converted here into the real cache, so the children's first loads only prepare weights.
    tokenizer = load_tokenizer(path)
    prompt_len, repeats = work_sizes["prompt_len"], work_sizes["repeats"]
    work = {
        **work_sizes,
        "prompts": [c.prompt_token_ids(tokenizer, prompt_len, seed=prompt_len * 100 + r)
                    for r in range(repeats)],
        "warmup": c.prompt_token_ids(tokenizer, 32, seed=1),
    }
    threads_env = {"OMP_NUM_THREADS": str(args.threads)}
    rows: dict[str, dict[str, Any]] = {}
    for mode in args.loom_modes:
        try:
            row = loom_mode_row(args, path, mode, work, threads_env)
        except (RuntimeError, KeyError, OSError) as exc:
            c.skip(f"{size_label(size)} loom {mode}: skipped (failed: {exc})")
            continue
        rows[loom_label(mode, row["resolved"])] = row
    if args.no_llama_cpp:
        c.skip(f"{size_label(size)} llama.cpp: skipped (--no-llama-cpp)")
    else:
        try:
            rows["llama.cpp"] = llama_cpp_row(args, path, work, read)
        except (RuntimeError, KeyError, OSError) as exc:
            c.skip(f"{size_label(size)} llama.cpp: skipped (failed: {exc})")
    add_limits(rows, bandwidth_gb_s)
    return {"file": str(path), "written": how_written(size), "file_bytes": path.stat().st_size,
            "tensor_bytes": total,
            "gguf_read_bytes_per_token": read, "engines": rows}


def choose_sizes(args: argparse.Namespace) -> list[str]:
    """The sizes to run: --sizes as given, else the defaults (--quick: 360M only); plus the
    8B with --with-8b when memory allows (skipped, and said so, otherwise)."""
    sizes = list(dict.fromkeys(args.sizes)) if args.sizes else list(
        QUICK_SIZES if args.quick else DEFAULT_SIZES)
    available = available_memory_gb()
    if BIG_SIZE in sizes:
        if available < BIG_MIN_AVAILABLE_GB:
            c.log(f"warning: {BIG_SIZE} asked for with {available:.1f} GB available")
    elif not args.with_8b:
        c.skip(f"{BIG_SIZE}: skipped (not asked: --with-8b or --sizes {BIG_SIZE})")
    elif available < BIG_MIN_AVAILABLE_GB:
        c.skip(f"{BIG_SIZE}: skipped ({available:.1f} GB of memory available, "
               f"--with-8b needs {BIG_MIN_AVAILABLE_GB:.0f})")
    else:
        sizes.append(BIG_SIZE)
    return sizes


def main() -> None:
    """Parse arguments (or run as a child), measure every size, report."""
    parser = c.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=None,
                        help=f"shapes ({', '.join(SHAPES)}) or GGUF paths; default: "
                             f"{' '.join(DEFAULT_SIZES)} (--quick: {' '.join(QUICK_SIZES)})")
    parser.add_argument("--with-8b", action="store_true",
                        help=f"also run {BIG_SIZE} when at least {BIG_MIN_AVAILABLE_GB:.0f} GB "
                             "of memory is available")
    parser.add_argument("--loom-modes", nargs="+", default=["auto", "w8a8+kv16"],
                        help="Loom modes (common.loom_mode_kwargs; auto = the engine default)")
    parser.add_argument("--prompt-len", type=int, default=512, help="TTFT prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="greedy tokens decoded (64; --quick: 16)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                        help="where the random GGUFs are kept (and the temporary caches made)")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args.child)
    if args.doc_only:
        return c.rerender(NAME, TITLE, render)
    args.cache_dir = args.cache_dir.expanduser()
    max_tokens = args.max_tokens or (16 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)
    sizes = choose_sizes(args)
    if args.no_hf:
        c.log("(--no-hf: this benchmark runs no transformers peer)")

    bandwidth = read_bandwidth(args.threads)
    c.log(f"read bandwidth: {bandwidth['gb_s']:.1f} GB/s ({BANDWIDTH_MIB} MiB sum, "
          f"{args.threads} threads, best of 5)")
    work_sizes = {"prompt_len": args.prompt_len, "max_tokens": max_tokens, "repeats": repeats}
    results: dict[str, Any] = {}
    for size in sizes:
        c.log(f"== {size_label(size)}")
        results[size_label(size)] = measure_size(args, size, work_sizes, bandwidth["gb_s"])

    dtypes = {r["dtype"] for s in results.values() for r in s["engines"].values() if "dtype" in r}
    random = all(s in SHAPES for s in sizes)
    args.model = ", ".join(size_label(s) for s in sizes) + (
        f" (random weights, {GGUF_TYPE.upper()}: benchmarks/random_gguf.py)"
        if random else "")
    sizes_note = (f"prompt {args.prompt_len} tokens, {max_tokens} greedy tokens, median of "
                  f"{repeats} distinct prompts; Loom modes {' '.join(args.loom_modes)}; "
                  f"{args.threads} threads")
    result = c.header(NAME, args, dtype=", ".join(sorted(dtypes)) or args.dtype,
                      sizes_note=sizes_note, sizes=[size_label(s) for s in sizes],
                      loom_modes=args.loom_modes, prompt_len=args.prompt_len,
                      max_tokens=max_tokens, repeats=repeats, threads=args.threads,
                      bandwidth=bandwidth, results=results)
    c.finish(NAME, TITLE, result, render, args.no_doc)


def render(result: dict[str, Any]) -> str:
    """The doc section's body: one row per size and engine."""
    rows = []
    for size, per_size in result["results"].items():
        for label, r in per_size["engines"].items():
            prepared = r.get("prepared_bytes")
            rows.append([
                size, label, per_size["file_bytes"] / GIB, r["decode_tok_s"], r["ttft_ms"],
                r["first_load_s"], r["first_load_rss_gib"], r.get("warm_load_s"),
                r.get("warm_load_rss_gib"), r["run_peak_rss_gib"],
                None if prepared is None else prepared / GIB,
                r["read_bytes_per_token"] / GIB, r["limit_tok_s"], r["decode_share_of_limit"],
                r.get("decode_over_llama_cpp"), r.get("ttft_over_llama_cpp"),
            ])
    table = c.markdown_table(
        ["model", "engine", "file GiB", "decode tok/s", f"TTFT ms ({result['prompt_len']})",
         "first load s", "first load peak RSS GiB", "warm load s", "warm load peak RSS GiB",
         "peak RSS after run GiB", "prepared GiB", "read/token GiB", "limit tok/s",
         "decode / limit", "decode Loom/llama.cpp", "TTFT Loom/llama.cpp"],
        rows,
    )
    bw = result["bandwidth"]
    files = "".join(f"\n- {size}: {s.get('written', '?')}, {s['file_bytes'] / GIB:.2f} GiB"
                    for size, s in result["results"].items())
    return (
        f"{table}\n\nFiles:\n{files}\n\n"
        f"Read bandwidth {bw['gb_s']:.1f} GB/s (`torch.ones(N).sum()` over {bw['mib']} MiB, "
        f"{bw['threads']} threads, best of 5, in this run); limit tok/s = bandwidth / bytes "
        "read per token: for llama.cpp the GGUF's tensor bytes, for Loom its prepared tensors "
        "(the input embedding left out where the output head is stored on its own). "
        "Decode Loom/llama.cpp above 1 and TTFT Loom/llama.cpp below 1 favour Loom. Each load "
        "runs in a fresh process; peak RSS is that process's VmHWM (imports included). Loom's "
        "first load has an empty prepared-weights cache, its warm load reads what the first wrote "
        "(\"prepared GiB\"), mapped: its pages become resident as the first steps read them, "
        "so the peak after the run is the warm figure to compare. llama.cpp has no prepared "
        "cache: its one load (the file mapped, already in the page cache) is in the first-load "
        f"columns, and its mapped pages count in its RSS once read.{_separate_runs(result)}"
        f"{c.skip_notes_md(result)}"
    )


def _separate_runs(result: dict[str, Any]) -> str:
    """A note for each size measured in a run of its own (its results merged into this
    one's JSON): its command, date and read bandwidth, which its limit column used."""
    notes = [f" {size} was measured in a run of its own (`{run['command']}`, {run['date']}; "
             f"read bandwidth {run['bandwidth_gb_s']:.1f} GB/s)."
             for size, s in result["results"].items()
             if (run := s.get("separate_run")) is not None]
    return "".join(notes)


if __name__ == "__main__":
    main()
