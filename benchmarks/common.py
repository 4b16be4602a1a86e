"""Shared helpers of the benchmark suite: timing, machine facts, results, peers, the doc table.

Every benchmark script prints its results as JSON, writes them to
`benchmarks/results/<name>.json` and replaces its own section of `docs/performance.md`
(between `<!-- bench:<name> -->` markers), so re-running one script refreshes one table.

Peers are optional: `load_hf` and `load_llama_cpp` return None (and print why) when the
package is missing, and the benchmark reports that peer as skipped.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
PERF_DOC = ROOT / "docs" / "performance.md"
DEFAULT_MODEL = "gemma3-270m"

if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

_DOC_HEADER = """# Performance

Numbers produced by the scripts in `benchmarks/`. Each section below is rewritten by the
script named in it (with the exact command, date and machine); raw results are in
`benchmarks/results/*.json`; `python benchmarks/plot.py` redraws the PNGs from them.

| script | what it measures |
|---|---|
| `bench_latency.py` | time to first token (512- and 2048-token prompts), greedy decode tok/s |
| `bench_throughput.py` | offline batch of mixed-length prompts: output and total tok/s |
| `bench_sessions.py` | live append of 16 tokens at growing contexts vs re-submitting |
| `bench_hooks.py` | `<promise>`/`<sync>` fan-out vs separate requests: time, peak KV blocks |
| `bench_quality.py` | int8 / w8a8 against float32: perplexity, top-1 and greedy-token agreement |
| `bench_speculative.py` | n-gram speculation vs plain decode, prompts without repeats |
| `bench_prefix.py` | prefix caching: shared-prefix TTFT and throughput, cache on vs off |
| `bench_invariance.py` | prompts alone vs batched, chunked, cached: tokens, logprobs that differ |
| `run_all.py` | all of them, then `plot.py` (`make bench`; `--quick` for small sizes) |

Every script takes `--quick`, `--repeats`, `--no-hf`, `--no-llama-cpp`, `--no-doc` and its
own size flags (`--help`). Peers run in the same process on the same weights: HF
`transformers` (the same GGUF, dequantised, at Loom's dtype unless the row says otherwise)
and llama.cpp through `llama-cpp-python` (the same Q4_K_M file, run quantised as llama.cpp
does). A peer that is not installed is skipped and listed as such. The machines are shared:
timings are noisy, so compare the ratios, which are measured within one run.
"""


# ---- timing --------------------------------------------------------------------------


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of a block, then restore them."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


# A child process of a benchmark prints its result as one line: this prefix, then JSON.
RESULT_PREFIX = "RESULT "


def run_result_child(cmd: Sequence[str], stdin: str | None = None,
                     env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `cmd` in a fresh process (this environment plus `env`, `stdin` on its input) and
    return the JSON of the last line it printed after RESULT_PREFIX, with "process_s", the
    wall time from launch to exit (RuntimeError with the tail of its stderr when it fails)."""
    start = time.perf_counter()
    proc = subprocess.run(list(cmd), input=stdin, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, check=False)
    wall = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr.strip()[-1500:]}")
    result = json.loads(lines[-1].removeprefix(RESULT_PREFIX))
    result["process_s"] = wall
    return result


def now() -> float:
    """Seconds from a monotonic high-resolution clock."""
    return time.perf_counter()


def median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence."""
    return float(statistics.median(values))


def time_call(fn: Callable[[], Any], warmup: int = 1, repeats: int = 3) -> dict[str, Any]:
    """Run `fn` `warmup` times untimed, then `repeats` times: median, min and every time (s)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = now()
        fn()
        times.append(now() - start)
    return {"median_s": median(times), "min_s": min(times), "times_s": times}


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b rounded, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


# ---- machine and arguments -----------------------------------------------------------


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (or platform's guess)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# CPU features that decide Loom's fast paths (bf16 and int8 products, AMX tiles).
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_isa() -> list[str]:
    """Which of the CPU features Loom cares about this host has (from /proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return [f for f in _ISA_FLAGS if f in flags]
    except OSError:
        pass
    return []


def machine_info() -> dict[str, Any]:
    """Cores, CPU model and features, torch version and threads, and which peers are
    installed."""
    import torch

    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "cpu": cpu_model(),
        "isa": cpu_isa(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    for name, module in (("transformers", "transformers"), ("llama_cpp", "llama_cpp")):
        try:
            info[name] = __import__(module).__version__
        except ImportError:
            info[name] = None
    return info


def base_parser(description: str) -> argparse.ArgumentParser:
    """Arguments every benchmark takes: model, dtype, peers, repeats, --quick, --no-doc."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="Loom model name or path")
    parser.add_argument("--dtype", default="auto", help="Loom dtype (auto/float32/bfloat16)")
    parser.add_argument("--device", default="auto", help="Loom device (auto/cpu/cuda)")
    parser.add_argument("--quantization", default="auto",
                        help="Loom quantization: auto (the engine's default: w8a8 + float16 KV "
                             "for a quantized GGUF on the CPU kernels), none (exact float), "
                             "int8, w8a8")
    parser.add_argument("--quick", action="store_true", help="small sizes (a few minutes)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (median)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads")
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    parser.add_argument("--no-doc", action="store_true", help="do not update performance.md")
    parser.add_argument("--doc-only", action="store_true",
                        help="re-render the doc section from the saved JSON; run nothing")
    return parser


def command_line() -> str:
    """The command that is running, as a user would type it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script_s = str(script.relative_to(ROOT))
    except ValueError:
        script_s = str(script)
    return " ".join(["python", script_s, *sys.argv[1:]])


def log(message: str) -> None:
    """Progress and skip notes go to stderr, so stdout holds only the JSON result."""
    print(message, file=sys.stderr, flush=True)


# Why peers were skipped in this process; `header` copies them into the result.
_SKIP_NOTES: list[str] = []


def skip(message: str) -> None:
    """Print a skip line (a peer or variant that did not run) and remember it for the doc."""
    _SKIP_NOTES.append(message)
    log(message)


def skip_notes_md(result: dict[str, Any]) -> str:
    """The result's skip lines as a markdown list (empty when nothing was skipped)."""
    notes = result.get("skip_notes") or [f"{s}: skipped" for s in result.get("skipped", [])]
    return "\n\nSkipped:\n" + "".join(f"\n- {n}" for n in notes) if notes else ""


# ---- prompts -------------------------------------------------------------------------

_TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps "
    "as his father had taught him. From the top he could see the harbour, the fishing boats "
    "returning with their nets, and the long line of hills beyond the town. He wrote in his "
    "logbook the direction of the wind, the colour of the sky and the names of the ships that "
    "passed. Some nights the fog rolled in so thick that the beam of the lamp seemed to stop "
    "a few metres from the glass, and he would sound the horn until dawn. "
)


def prompt_token_ids(tokenizer: Any, num_tokens: int, seed: int = 0) -> list[int]:
    """A deterministic prompt of exactly `num_tokens` ids (BOS first, where the tokenizer
    adds one) of natural English.

    The same ids are fed to every engine, so all of them compute the same sequence.
    """
    rng = random.Random(seed)
    body = tokenizer.encode(_TEXT, add_special_tokens=False)
    ids = tokenizer.encode("", add_special_tokens=True)[:1] if num_tokens > 0 else []
    while len(ids) < num_tokens:
        start = rng.randrange(len(body))
        ids.extend(body[start:] + body[:start])
    return ids[:num_tokens]


def model_path(model: str) -> Path:
    """The GGUF file (or folder) behind a Loom model name."""
    from loom.loader.resolve import resolve_model_path

    return resolve_model_path(model)


# ---- peers ---------------------------------------------------------------------------


def hf_dtype_name(loom_dtype: str) -> str:
    """The torch dtype name HF should use to match Loom's resolved dtype."""
    return {"bf16": "bfloat16", "fp32": "float32"}.get(loom_dtype, loom_dtype)


def load_hf(model: str, dtype: str, device: str = "cpu", disabled: bool = False) -> Any | None:
    """An HF transformers model on the same weights, or None (printed why).

    Only the model is loaded: every engine is fed the same token ids, so HF's tokenizer
    (slow to convert from GGUF metadata) is not needed.
    """
    if disabled:
        skip("transformers: skipped (--no-hf)")
        return None
    try:
        import torch
        import transformers
    except ImportError:
        skip("transformers: skipped (not installed; pip install 'loom-llm[bench]')")
        return None
    path = model_path(model)
    folder, kwargs = (path.parent, {"gguf_file": path.name}) if path.is_file() else (path, {})
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=getattr(torch, dtype), **kwargs
        )
    except Exception as exc:  # a peer failing to load must not stop the benchmark
        skip(f"transformers: skipped (could not load {path.name}: {exc})")
        return None
    return hf.to(device).eval()


def peer_device(args: argparse.Namespace) -> str:
    """The device transformers runs on: Loom's (`--device`, "auto" resolved the same way)."""
    from loom.engine.resolve import resolve_device

    return resolve_device(args.device)


def hf_pad_id(hf: Any) -> int:
    """The pad token id of an HF model's config (0 when it has none)."""
    pad = getattr(hf.config, "pad_token_id", None)
    if pad is None and getattr(hf, "generation_config", None) is not None:
        pad = hf.generation_config.pad_token_id
    return int(pad or 0)


def load_llama_cpp(model: str, n_ctx: int, threads: int, n_batch: int = 512,
                   disabled: bool = False, logits_all: bool = False) -> Any | None:
    """A `llama_cpp.Llama` on the same GGUF file, or None (printed why). `logits_all`: keep
    every position's logits (`Llama.scores`), not just the last."""
    if disabled:
        skip("llama.cpp: skipped (--no-llama-cpp)")
        return None
    try:
        import llama_cpp
    except ImportError:
        skip("llama.cpp: skipped (llama-cpp-python not installed; pip install llama-cpp-python)")
        return None
    path = model_path(model)
    if not path.is_file() or path.suffix != ".gguf":
        skip(f"llama.cpp: skipped ({path} is not a GGUF file)")
        return None
    try:
        return llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=logits_all,
            verbose=False,
        )
    except Exception as exc:
        skip(f"llama.cpp: skipped (could not load {path.name}: {exc})")
        return None


def llama_cpp_truncate(llm: Any, num_tokens: int) -> None:
    """Drop llama.cpp's cached tokens past `num_tokens` (KV and its token record)."""
    llm.n_tokens = num_tokens
    llm._ctx.kv_cache_seq_rm(-1, num_tokens, -1)


class TimestampStreamer:
    """An HF `generate` streamer that records when each new token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        """Called by `generate` with the prompt first, then with the new token(s): several
        at once when speculative decoding accepts drafts."""
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.extend([now()] * max(1, int(value.numel())))

    def end(self) -> None:
        """Called once at the end of generation."""


# ---- results -------------------------------------------------------------------------


def write_results(name: str, result: dict[str, Any]) -> Path:
    """Print the JSON to stdout and write it to benchmarks/results/<name>.json."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2, default=str)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(text + "\n")
    print(text, flush=True)
    return path


def header(name: str, args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """The common head of a result: benchmark, command, date, machine, model, sizes."""
    return {
        "benchmark": name,
        "command": command_line(),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "model": args.model,
        "quick": bool(getattr(args, "quick", False)),
        **extra,
        "skip_notes": list(_SKIP_NOTES),
    }


def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: numbers rounded, None as an em dash."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def update_doc(name: str, title: str, result: dict[str, Any], body: str) -> None:
    """Replace (or append) this benchmark's section of docs/performance.md."""
    m = result["machine"]
    meta = (
        f"`{result['command']}` — {result['date']}  \n"
        f"Machine: {m['cores']} cores, {m['cpu']}"
        + (f" ({', '.join(m['isa'])})" if m.get("isa") else "")
        + f", torch {m['torch']} "
        f"({m['torch_threads']} threads)"
        + (f", CUDA {m['cuda']}" if m.get("cuda") else "")
        + f"; transformers {m['transformers'] or 'not installed'}, "
        f"llama-cpp-python {m['llama_cpp'] or 'not installed'}.  \n"
        f"Model: `{result['model']}`; Loom dtype: {result.get('dtype', '?')}; "
        f"sizes: {result.get('sizes_note', '')}"
    )
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    section = f"{start}\n## {title}\n\n{meta}\n\n{body.strip()}\n{end}"
    text = PERF_DOC.read_text() if PERF_DOC.exists() else _DOC_HEADER
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    PERF_DOC.parent.mkdir(parents=True, exist_ok=True)
    PERF_DOC.write_text(text)
    log(f"updated {PERF_DOC.relative_to(ROOT)} (section {name})")


def finish(name: str, title: str, result: dict[str, Any],
           render: Callable[[dict[str, Any]], str], no_doc: bool) -> None:
    """Write the JSON result and, unless disabled, the doc section `render` makes of it."""
    write_results(name, result)
    if not no_doc:
        update_doc(name, title, result, render(result))


def rerender(name: str, title: str, render: Callable[[dict[str, Any]], str]) -> None:
    """Rewrite the doc section from benchmarks/results/<name>.json (`--doc-only`)."""
    result = json.loads((RESULTS_DIR / f"{name}.json").read_text())
    update_doc(name, title, result, render(result))


# ---- Loom ----------------------------------------------------------------------------


def make_engine(args: argparse.Namespace, **kwargs: Any) -> Any:
    """An `LLMEngine` for the benchmark's model, dtype and device."""
    from loom import EngineArgs, LLMEngine

    base = {"model": args.model, "dtype": args.dtype, "device": args.device,
            "quantization": getattr(args, "quantization", "auto")}
    return LLMEngine.from_engine_args(EngineArgs(**{**base, **kwargs}))


def loom_mode_kwargs(mode: str) -> dict[str, Any]:
    """Engine arguments of a Loom variant name: "default" (the engine's defaults), "float"
    (exact float weights: quantization None) or a quantization ("int8", "w8a8"), optionally
    "+kv16" for a float16 KV cache, "+ngram" for speculative decoding with n-gram drafts and
    "+tokN" for steps of up to N tokens (max_num_batched_tokens; e.g. "w8a8+kv16+ngram",
    "default+tok2048") and "+cublas" for cuBLAS's GEMMs on CUDA instead of the
    batch-invariant matmul (EngineArgs.batch_invariant=False)."""
    kwargs: dict[str, Any] = {}
    for part in mode.split("+"):
        if part == "kv16":
            kwargs["kv_cache_dtype"] = "float16"
        elif part == "ngram":
            kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 4}
        elif part == "float":
            kwargs["quantization"] = None
        elif part == "cublas":
            kwargs["batch_invariant"] = False
        elif part == "default":
            kwargs["quantization"] = "auto"
        elif part.startswith("tok") and part[3:].isdigit():
            kwargs["max_num_batched_tokens"] = int(part[3:])
        else:
            kwargs["quantization"] = part
    return kwargs


def engine_label(config: Any) -> str:
    """A resolved engine mode as a benchmark label: "float32", "w8a8+kv16", "int8", ..."""
    label = config.quantization or config.dtype
    if config.kv_cache_dtype != config.dtype:
        label += {"float16": "+kv16", "bfloat16": "+kvbf16"}.get(
            config.kv_cache_dtype, f"+kv {config.kv_cache_dtype}")
    return label


def try_variant_engine(
    args: argparse.Namespace, mode: str = "int8", **kwargs: Any
) -> Any | None:
    """An engine for a Loom variant (see `loom_mode_kwargs`: "int8", "w8a8", "w8a8+kv16")
    if accepted, else None (printed)."""
    try:
        return make_engine(args, **loom_mode_kwargs(mode), **kwargs)
    except Exception as exc:
        skip(f"loom {mode}: skipped (quantization={mode!r} not accepted: {exc})")
        return None


def settle(engine: Any, on_step: Callable[[], None] | None = None) -> None:
    """Step the engine until nothing waits or runs (paused sessions do not count), then wait
    for the device: a step that only stores logits (a session's prefill) copies nothing back,
    so on a GPU its work may still be running when `step` returns."""
    while engine.has_unfinished_requests():
        engine.step()
        if on_step is not None:
            on_step()
    device_sync()


def device_sync() -> None:
    """Wait for queued GPU work (nothing to wait for on a CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
