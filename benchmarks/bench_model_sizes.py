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

Mixtures of experts (issue 45), only when `--sizes` names them, in a run of their own (their
own result, `model_sizes_moe.json`, and doc section): `qwen3-30b-a3b` (Qwen3-30B-A3B's
layers: 128 experts of width 768, 8 a token, QK-norm; 16 of its 48 layers), `mixtral-8x7b`
(Mixtral-8x7B's: 8 experts of width 14336, 2 a token, GGUF arch "llama"; 4 of its 32
layers), `olmoe-1b-7b` (OLMoE-1B-7B's: 64 experts of width 1024, 8 a token, QK-norms over
all heads; all 16 layers), written by `benchmarks/random_moe_gguf.py` (Q4_K_M's blocks
written directly, SmolLM2's tokenizer; `--moe-layers N` writes another cut), and
`gpt-oss-20b` (gpt-oss-20b's: 32 experts of width 2880, 4 a token, attention sinks, biases,
a 128-token window on alternate layers, YaRN; 8 of its 24 layers; MXFP4 experts and Q8_0
embedding, output head and attention as ggml-org's gpt-oss-20b-mxfp4.gguf; its real
201,088-token vocabulary: SmolLM2's tokenizer padded). Loom runs its default mode only
unless `--loom-modes` says otherwise. Besides the above, per engine: the total decode tok/s
of `--streams` (8) concurrent streams (Loom: one engine; llama.cpp: one context with that
many sequences, through llama-cpp-python's low-level batch API), sampled at
`--stream-temperature` (1: greedy decoding of random weights repeats one token in every
stream, whose steps would then share their experts); the time to read the file from disk
with the page cache dropped (root), and each engine's first load after the page cache is
dropped the same way (llama.cpp then loads again, warm, and measures); bytes per token count
only the active experts' share of the expert tensors (experts_used / experts) besides the
dense parts; and the issue's targets, met or not.

    python benchmarks/bench_model_sizes.py                     # 360M, 1.7B, 3B
    python benchmarks/bench_model_sizes.py --with-8b           # and 8B when memory allows
    python benchmarks/bench_model_sizes.py --sizes smollm2-1.7b --loom-modes auto w4a8 w8a8
    python benchmarks/bench_model_sizes.py --quick --no-doc    # 360M only, 16 tokens
    python benchmarks/bench_model_sizes.py --doc-only          # re-render the doc section(s)
    python benchmarks/bench_model_sizes.py --sizes qwen3-30b-a3b mixtral-8x7b  # MoE (issue 45)
    python benchmarks/bench_model_sizes.py --sizes qwen3-30b-a3b mixtral-8x7b gpt-oss-20b
    python benchmarks/bench_model_sizes.py --sizes qwen3-30b-a3b mixtral-8x7b olmoe-1b-7b \
        gpt-oss-20b
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
from random_moe_gguf import (
    MOE_SHAPES,
    file_type,
    layer_cut,
    tensor_types,
    with_layers,
    write_random_moe_gguf,
)

NAME = "model_sizes"
TITLE = "Model sizes: Loom against llama.cpp on 0.36-8B Q4_K_M GGUFs"
NAME_MOE = "model_sizes_moe"
TITLE_MOE = "Mixtures of experts against llama.cpp (issue 45, 2026-11-27)"
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
    if size in MOE_SHAPES:
        return moe_model_file(size, cache_dir)
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


def moe_model_file(size: str, cache_dir: Path) -> Path:
    """The random mixture-of-experts GGUF of `size` in `cache_dir`, its layer cut in the
    name (written once, atomically, and reused; `benchmarks/random_moe_gguf.py`)."""
    shape = MOE_SHAPES[size]
    path = cache_dir / f"{size}-{shape.layers}of{shape.full_layers}L-{file_type(shape)}.gguf"
    if path.is_file():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    c.log(f"{size}: writing {path} (random weights, {how_written(size)}) ...")
    partial = path.with_name(path.name + ".partial")
    try:
        write_random_moe_gguf(partial, shape, log=c.log)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
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
    if size in MOE_SHAPES:
        shape = MOE_SHAPES[size]
        return f"{tensor_types(shape)}, {layer_cut(shape)} (random_moe_gguf.py)"
    if size not in SHAPES:
        return "the file as given"
    if needs_quantiser(size):
        return ("random F16 quantised by llama.cpp's Q4_K_M (its fallback types where rows "
                "are not whole 256-wide blocks)")
    return "random Q4_K / Q6_K blocks in Q4_K_M's mix (random_gguf.py)"


def size_label(size: str) -> str:
    """A size's name in the table: the shape's name, or a file's stem."""
    return size if size in SHAPES or size in MOE_SHAPES else Path(size).stem


def is_moe(size: str) -> bool:
    """Whether a size is one of the mixture-of-experts shapes."""
    return size in MOE_SHAPES


SMOLLM2_TOKENIZER = "SmolLM2's tokenizer"


def moe_tokenizer(size: str, vocab: int) -> str:
    """Where a mixture-of-experts file's vocabulary comes from, for the results."""
    if MOE_SHAPES[size].arch == "gpt-oss":
        return (f"SmolLM2's tokenizer padded to {vocab:,} with ordinary [pad_N] tokens, then "
                "control <|reserved_N|> ones from id 199,998; pre-tokenizer gpt-4o")
    return SMOLLM2_TOKENIZER


def gguf_experts(path: Path) -> tuple[int, int]:
    """(experts, experts used per token) of a GGUF file; (0, 0) for a dense one."""
    from loom.loader.gguf_reader import GGUFFile

    f = GGUFFile(path)
    arch = f.get("general.architecture")
    return (int(f.get(f"{arch}.expert_count") or 0),
            int(f.get(f"{arch}.expert_used_count") or 0))


def gguf_vocab(path: Path) -> int:
    """The vocabulary of a GGUF file: its embedding's rows."""
    from loom.loader.gguf_reader import GGUFFile

    return next(t.shape[0] for t in GGUFFile(path).tensors if t.name == "token_embd.weight")


def gguf_read_bytes(path: Path) -> tuple[int, int]:
    """(all tensor bytes, bytes a decode step reads: all but the input embedding when the
    file has a separate output head) of a GGUF file. In a mixture of experts a token reads
    only its experts: each expert tensor (`*_exps`, or the older per-expert `ffn_*.{e}`)
    counts `used / experts` of its bytes, the dense parts (attention, router, norms, output
    head) in full."""
    from loom.loader.gguf_reader import GGUFFile

    tensors = GGUFFile(path).tensors
    experts, used = gguf_experts(path)
    total = sum(t.nbytes for t in tensors)
    separate_head = any(t.name == "output.weight" for t in tensors)
    read = 0.0
    for t in tensors:
        if separate_head and t.name == "token_embd.weight":
            continue
        read += t.nbytes * (used / experts if experts and _is_expert_gguf(t.name) else 1)
    return total, round(read)


def _is_expert_gguf(name: str) -> bool:
    """Whether a GGUF tensor holds experts' weights (not the router, `ffn_gate_inp`)."""
    parts = name.split(".")
    return "_exps" in name or (len(parts) == 5 and parts[2] in ("ffn_gate", "ffn_up",
                                                                 "ffn_down"))


def prepared_read_bytes(files: list[Path], expert_fraction: float = 1.0) -> int:
    """Bytes of the tensors in Loom's prepared safetensors file(s) a decode step reads: all
    but the input embedding when the output head is stored on its own (a tied head aliases
    the embedding and is not stored twice); the experts' tensors (`.mlp.experts.`) count
    `expert_fraction` (used / experts) of their bytes."""
    total = 0.0
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
            total += (end - start) * (expert_fraction if ".mlp.experts." in name else 1)
    return round(total)


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


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the kernel's page cache (`sync; echo 3 >
    /proc/sys/vm/drop_caches`: needs root); whether it was dropped."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def cold_read(path: Path, chunk_mib: int = 16) -> dict[str, Any]:
    """The time to read `path` from disk: the page cache dropped first (where allowed), then
    the file read through once in `chunk_mib` MiB reads, as `cat file > /dev/null`."""
    dropped = drop_page_cache()
    buffer = bytearray(chunk_mib * 2**20)
    view = memoryview(buffer)
    start = c.now()
    nbytes = 0
    with path.open("rb", buffering=0) as f:
        while got := f.readinto(view):
            nbytes += got
    seconds = c.now() - start
    return {"s": round(seconds, 3), "gb_s": round(nbytes / seconds / 1e9, 3),
            "bytes": nbytes, "page_cache_dropped": dropped}


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
    if spec.get("streams"):
        streams = spec["streams"]
        temperature = streams["temperature"]
        loom_streams(llm.engine, streams["warmup"], 4, temperature)  # the first many-row steps
        out["streams"] = loom_streams(llm.engine, streams["prompts"], streams["max_tokens"],
                                      temperature)
        out["streams_peak_rss_gib"] = peak_rss_gib()
    return out


def stream_rates(start: float, marks: list[tuple[float, int, int]], streams: int,
                 ) -> dict[str, Any]:
    """Throughput of `streams` concurrent greedy streams from `marks`, (time, streams with a
    token so far, tokens so far) after each step: "decode_total_tok_s" counts the tokens
    made once every stream has its first token (all prefills done) over the time from then
    to the last; "overall_tok_s" every token over the time from submission (prefills
    included)."""
    end, _, total = marks[-1]
    began = next(m for m in marks if m[1] == streams)
    return {"streams": streams, "tokens": total, "wall_s": round(end - start, 3),
            "overall_tok_s": round(total / (end - start), 3),
            "decode_total_tok_s": round((total - began[2]) / (end - began[0]), 3),
            "prefill_s": round(began[0] - start, 3)}


def loom_streams(engine: Any, prompts: list[list[int]], max_tokens: int,
                 temperature: float) -> dict[str, Any]:
    """All `prompts` submitted at once to one Loom engine (EOS ignored; greedy at
    temperature 0, else sampled with a seed per stream), stepped until every stream has
    `max_tokens` tokens."""
    from loom import SamplingParams

    counts: dict[str, int] = {}
    marks: list[tuple[float, int, int]] = []
    start = c.now()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                ignore_eos=True, seed=1000 + i)
        engine.add_request(f"stream-{i}-{start}", prompt, params)
    while engine.has_unfinished_requests():
        outs = engine.step()
        for out in outs:
            counts[out.request_id] = len(out.outputs[0].token_ids)
        if outs:
            marks.append((c.now(), sum(1 for n in counts.values() if n), sum(counts.values())))
    assert sum(counts.values()) == len(prompts) * max_tokens, counts
    return stream_rates(start, marks, len(prompts))


def llama_cpp_streams(llm: Any, prompts: list[list[int]], max_tokens: int, threads: int,
                      temperature: float) -> dict[str, Any]:
    """All `prompts` as concurrent sequences of one llama.cpp context, as its `batched`
    example and its server's parallel slots run them: a context with `n_seq_max` =
    len(prompts) on the loaded model, the prompts prefilled in batches of up to 512 tokens,
    then one `llama_decode` per step with one token of every sequence; greedy (argmax of each
    sequence's logits) at temperature 0, else llama.cpp's own sampler chain (temperature,
    then `dist` with a seed)."""
    import ctypes

    import llama_cpp as L
    import numpy as np

    n = len(prompts)
    params = L.llama_context_default_params()
    per_sequence = -(-(max(map(len, prompts)) + max_tokens + 16) // 256) * 256
    params.n_ctx = n * per_sequence  # each sequence's share (llama.cpp rounds to 256)
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = n
    params.n_threads = params.n_threads_batch = threads
    ctx = L.llama_init_from_model(llm.model, params)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(llm.model))
    batch = L.llama_batch_init(512, 0, n)
    sampler = None
    if temperature > 0:
        sampler = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        L.llama_sampler_chain_add(sampler, L.llama_sampler_init_temp(temperature))
        L.llama_sampler_chain_add(sampler, L.llama_sampler_init_dist(1000))

    def decode(entries: list[tuple[int, int, int, bool]]) -> list[tuple[int, int]]:
        """(token, position, sequence, wants logits) -> (sequence, greedy next token)."""
        for j, (token, pos, seq, logits) in enumerate(entries):
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = token, pos, 1
            batch.seq_id[j][0], batch.logits[j] = seq, logits
        batch.n_tokens = len(entries)
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        picked = []
        for j, (_, _, seq, logits) in enumerate(entries):
            if logits and sampler is not None:
                picked.append((seq, int(L.llama_sampler_sample(sampler, ctx, j))))
            elif logits:
                row = ctypes.cast(L.llama_get_logits_ith(ctx, j), ctypes.POINTER(ctypes.c_float))
                picked.append((seq, int(np.ctypeslib.as_array(row, (n_vocab,)).argmax())))
        return picked

    try:
        counts = [0] * n
        last, pos = [0] * n, [len(p) for p in prompts]
        marks: list[tuple[float, int, int]] = []
        start = c.now()
        pending = [(tok, i, s, i == len(p) - 1) for s, p in enumerate(prompts)
                   for i, tok in enumerate(p)]
        for at in range(0, len(pending), 512):
            for seq, token in decode(pending[at:at + 512]):
                last[seq], counts[seq] = token, 1
            marks.append((c.now(), sum(1 for k in counts if k), sum(counts)))
        while min(counts) < max_tokens:
            step = [(last[s], pos[s], s, True) for s in range(n) if counts[s] < max_tokens]
            for seq, token in decode(step):
                last[seq] = token
                pos[seq] += 1
                counts[seq] += 1
            marks.append((c.now(), n, sum(counts)))
        return stream_rates(start, marks, n)
    finally:
        if sampler is not None:
            L.llama_sampler_free(sampler)
        L.llama_batch_free(batch)
        L.llama_free(ctx)


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
    if spec.get("streams"):
        streams = spec["streams"]
        temperature = streams["temperature"]
        llama_cpp_streams(llm, streams["warmup"], 4, spec["threads"], temperature)
        out["streams"] = llama_cpp_streams(llm, streams["prompts"], streams["max_tokens"],
                                           spec["threads"], temperature)
        out["streams_peak_rss_gib"] = peak_rss_gib()
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
    """First load (empty prepared cache), warm load plus TTFT/decode, prepared bytes. With
    `work["cold"]` (the mixtures of experts) the page cache is dropped before the first load,
    so it reads the file from disk; with `work["streams"]` the warm process also runs that
    many concurrent streams."""
    spec = {"path": str(path), "mode": mode, "dtype": args.dtype, "device": args.device}
    with empty_prepared_cache(args.cache_dir) as cache:
        env = {**threads_env, "LOOM_CACHE_DIR": str(cache), "LOOM_PREPARED_CACHE": "1"}
        cold = bool(work.get("cold")) and drop_page_cache()
        c.log(f"  loom {mode}: first load (empty prepared cache"
              f"{', page cache dropped' if cold else ''}) ...")
        first = run_child("load-loom", spec, env)
        files = sorted(p for p in (cache / "prepared").rglob("*") if p.is_file())
        prepared = sum(p.stat().st_size for p in files)
        read = prepared_read_bytes([p for p in files if p.suffix == ".safetensors"],
                                   work.get("expert_fraction", 1.0))
        c.log(f"  loom {mode}: first load {first['load_s']:.2f} s, peak "
              f"{first['load_peak_rss_gib']:.2f} GiB, prepared {prepared / GIB:.2f} GiB; "
              "warm load and measurement ...")
        warm_spec = {**spec, "run": work}
        if work.get("streams"):
            warm_spec["streams"] = work["streams"]
        # The first load leaves gigabytes of prepared weights to write back; the warm process
        # measures a steady state, not the kernel's writeback on one of two cores (measured:
        # decode at half speed for its first prompts while it ran).
        os.sync()
        warm = run_child("load-loom", warm_spec, env)
    c.log(f"  {loom_label(mode, warm['resolved'])}: warm load {warm['load_s']:.2f} s, TTFT "
          f"{warm['ttft_ms']:.0f} ms, decode {warm['decode_tok_s']:.2f} tok/s"
          + _streams_log(warm))
    return {
        "engine": "loom", "mode": mode, "resolved": warm["resolved"], "dtype": warm["dtype"],
        "mode_summary": warm["mode_summary"],
        "first_load_s": first["load_s"], "first_load_rss_gib": first["load_peak_rss_gib"],
        "first_process_s": first["process_s"], "first_load_cold": cold,
        "warm_load_s": warm["load_s"], "warm_load_rss_gib": warm["load_peak_rss_gib"],
        "prepared_bytes": prepared, "prepared_files": [p.name for p in files],
        "read_bytes_per_token": read, "read_bytes_source": "prepared tensors",
        **_run_part(warm),
    }


def llama_cpp_row(args: argparse.Namespace, path: Path, work: dict[str, Any],
                  read_bytes: int) -> dict[str, Any]:
    """llama.cpp's load (time, peak RSS) and TTFT/decode in one fresh process. With
    `work["cold"]` a first process only loads, after the page cache is dropped (the file read
    from disk: llama.cpp maps it with MAP_POPULATE), and a second loads again (warm) and
    measures; with `work["streams"]` that one also runs the concurrent streams."""
    n_ctx = work["prompt_len"] + work["max_tokens"] + 64
    spec = {"path": str(path), "n_ctx": n_ctx, "threads": args.threads, "run": work}
    first = None
    if work.get("cold"):
        cold = drop_page_cache()
        c.log(f"  llama.cpp: first load{' (page cache dropped)' if cold else ''} ...")
        first = run_child("load-llama", {**spec, "run": None})
        first["cold"] = cold
        c.log(f"  llama.cpp: first load {first['load_s']:.2f} s, peak "
              f"{first['load_peak_rss_gib']:.2f} GiB; warm load and measurement ...")
        if work.get("streams"):
            spec["streams"] = work["streams"]
    else:
        c.log("  llama.cpp: load and measurement ...")
    got = run_child("load-llama", spec)
    c.log(f"  llama.cpp: load {got['load_s']:.2f} s, TTFT {got['ttft_ms']:.0f} ms, decode "
          f"{got['decode_tok_s']:.2f} tok/s" + _streams_log(got))
    if first is None:
        return {
            "engine": "llama.cpp", "first_load_s": got["load_s"],
            "first_load_rss_gib": got["load_peak_rss_gib"], "first_process_s": got["process_s"],
            "read_bytes_per_token": read_bytes, "read_bytes_source": "GGUF tensor bytes",
            **_run_part(got),
        }
    return {
        "engine": "llama.cpp", "first_load_s": first["load_s"],
        "first_load_rss_gib": first["load_peak_rss_gib"],
        "first_process_s": first["process_s"], "first_load_cold": first["cold"],
        "warm_load_s": got["load_s"], "warm_load_rss_gib": got["load_peak_rss_gib"],
        "read_bytes_per_token": read_bytes, "read_bytes_source": "GGUF tensor bytes",
        **_run_part(got),
    }


def _streams_log(got: dict[str, Any]) -> str:
    streams = got.get("streams")
    if not streams:
        return ""
    return (f", {streams['streams']} streams {streams['decode_total_tok_s']:.2f} tok/s in all "
            f"(decode; {streams['overall_tok_s']:.2f} with the prefills)")


def loom_label(mode: str, resolved: str) -> str:
    """A Loom row's name: the mode asked for, and what it resolved to where that differs."""
    return f"loom {mode}" if resolved == mode else f"loom {mode} ({resolved})"


def _run_part(got: dict[str, Any]) -> dict[str, Any]:
    keys = ("ttft_ms", "decode_tok_s", "ttft_ms_all", "decode_tok_s_all", "run_peak_rss_gib")
    part = {k: got[k] for k in keys}
    for key in ("streams", "streams_peak_rss_gib"):
        if key in got:
            part[key] = got[key]
    return part


def add_limits(rows: dict[str, dict[str, Any]], bandwidth_gb_s: float,
               cold_read_s: float | None = None) -> None:
    """Each row's tok/s limit (bandwidth / bytes per token), its decode share of it, and the
    Loom rows' ratios to llama.cpp; where measured, the concurrent streams' total over one
    stream's decode, and the first load over the time to read the file from disk."""
    peer = rows.get("llama.cpp")
    for label, row in rows.items():
        limit = c.ratio(bandwidth_gb_s * 1e9, row["read_bytes_per_token"])  # None: no bytes
        row["limit_tok_s"] = limit
        row["decode_share_of_limit"] = c.ratio(row["decode_tok_s"], limit)
        streams = row.get("streams")
        if streams:
            row["streams_over_one_stream"] = c.ratio(streams["decode_total_tok_s"],
                                                     row["decode_tok_s"])
        if cold_read_s:
            row["first_load_over_cold_read"] = c.ratio(row["first_load_s"], cold_read_s)
        if peer is not None and label != "llama.cpp":
            row["decode_over_llama_cpp"] = c.ratio(row["decode_tok_s"], peer["decode_tok_s"])
            row["ttft_over_llama_cpp"] = c.ratio(row["ttft_ms"], peer["ttft_ms"])
            if cold_read_s is not None:  # the mixtures of experts: the other ratios too
                row["run_rss_over_llama_cpp"] = c.ratio(row["run_peak_rss_gib"],
                                                        peer["run_peak_rss_gib"])
                row["first_load_rss_over_llama_cpp"] = c.ratio(row["first_load_rss_gib"],
                                                               peer["run_peak_rss_gib"])
                row["first_load_over_llama_cpp"] = c.ratio(row["first_load_s"],
                                                           peer["first_load_s"])
                if streams and peer.get("streams"):
                    row["streams_over_llama_cpp"] = c.ratio(
                        streams["decode_total_tok_s"], peer["streams"]["decode_total_tok_s"])


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
    moe: dict[str, Any] = {}
    if is_moe(size):
        shape = MOE_SHAPES[size]
        experts, used = gguf_experts(path)
        moe = {"arch": shape.arch, "layers": shape.layers, "full_layers": shape.full_layers,
               "layer_cut": layer_cut(shape), "experts": experts, "experts_used": used,
               "expert_ffn": shape.expert_ffn, "vocab": gguf_vocab(path)}
        moe["tokenizer"] = moe_tokenizer(size, moe["vocab"])
        n, length = args.streams, args.stream_prompt_len
        work["cold"] = True
        work["expert_fraction"] = used / experts
        work["streams"] = {
            "prompts": [c.prompt_token_ids(tokenizer, length, seed=7000 + s) for s in range(n)],
            "warmup": [c.prompt_token_ids(tokenizer, 16, seed=8000 + s) for s in range(n)],
            "max_tokens": work_sizes["max_tokens"], "prompt_len": length,
            "temperature": args.stream_temperature}
        c.log(f"  cold read of {path.name} ...")
        moe["cold_read"] = cold_read(path)
        c.log(f"  cold read: {moe['cold_read']['s']:.1f} s "
              f"({moe['cold_read']['gb_s']:.2f} GB/s, page cache dropped: "
              f"{moe['cold_read']['page_cache_dropped']})")
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
    add_limits(rows, bandwidth_gb_s, moe["cold_read"]["s"] if moe else None)
    out = {"file": str(path), "written": how_written(size), "file_bytes": path.stat().st_size,
           "tensor_bytes": total,
           "gguf_read_bytes_per_token": read, "engines": rows}
    if moe:
        out["moe"] = moe
    return out


def choose_sizes(args: argparse.Namespace) -> list[str]:
    """The sizes to run: --sizes as given, else the defaults (--quick: 360M only); plus the
    8B with --with-8b when memory allows (skipped, and said so, otherwise)."""
    sizes = list(dict.fromkeys(args.sizes)) if args.sizes else list(
        QUICK_SIZES if args.quick else DEFAULT_SIZES)
    if any(is_moe(s) for s in sizes):  # a run of the mixtures of experts: no 8B note
        return sizes
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
    parser.add_argument("--loom-modes", nargs="+", default=None,
                        help="Loom modes (common.loom_mode_kwargs; auto = the engine default); "
                             "default: auto w8a8+kv16 (mixtures of experts: auto)")
    parser.add_argument("--streams", type=int, default=8,
                        help="mixtures of experts: concurrent streams measured in one engine")
    parser.add_argument("--stream-prompt-len", type=int, default=64,
                        help="mixtures of experts: each concurrent stream's prompt tokens")
    parser.add_argument("--stream-temperature", type=float, default=1.0,
                        help="mixtures of experts: the concurrent streams' sampling "
                             "temperature (0: greedy; see the doc section)")
    parser.add_argument("--moe-layers", type=int, default=None,
                        help="mixtures of experts: layers written (default: each shape's cut, "
                             + ", ".join(f"{k} {layer_cut(v)}" for k, v in MOE_SHAPES.items())
                             + ")")
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
        c.rerender(NAME, TITLE, render)
        if (c.RESULTS_DIR / f"{NAME_MOE}.json").is_file():
            c.rerender(NAME_MOE, TITLE_MOE, render_moe)
        return None
    args.cache_dir = args.cache_dir.expanduser()
    max_tokens = args.max_tokens or (16 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)
    sizes = choose_sizes(args)
    moe = [s for s in sizes if is_moe(s)]
    if moe and len(moe) != len(sizes):
        raise SystemExit("--sizes: run the mixtures of experts "
                         f"({', '.join(MOE_SHAPES)}) in a run of their own")
    name, title, render_fn = (NAME_MOE, TITLE_MOE, render_moe) if moe else (NAME, TITLE, render)
    if args.moe_layers:
        for size in moe:
            MOE_SHAPES[size] = with_layers(MOE_SHAPES[size], args.moe_layers)
    if args.loom_modes is None:
        args.loom_modes = ["auto"] if moe else ["auto", "w8a8+kv16"]
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
    if moe:
        mixes = sorted({"MXFP4 experts, Q8_0 dense" if file_type(MOE_SHAPES[s]) == "mxfp4"
                        else f"{GGUF_TYPE.upper()}'s mix" for s in sizes})
        args.model = ", ".join(f"{s} ({layer_cut(MOE_SHAPES[s])})" for s in sizes) + (
            f" (random weights, {' / '.join(mixes)}: benchmarks/random_moe_gguf.py)")
    sizes_note = (f"prompt {args.prompt_len} tokens, {max_tokens} greedy tokens, median of "
                  f"{repeats} distinct prompts; Loom modes {' '.join(args.loom_modes)}; "
                  f"{args.threads} threads")
    if moe:
        sizes_note += (f"; {args.streams} concurrent streams of {args.stream_prompt_len}-token "
                       f"prompts, {max_tokens} tokens each, temperature "
                       f"{args.stream_temperature:g}")
    result = c.header(name, args, dtype=", ".join(sorted(dtypes)) or args.dtype,
                      sizes_note=sizes_note, sizes=[size_label(s) for s in sizes],
                      loom_modes=args.loom_modes, prompt_len=args.prompt_len,
                      max_tokens=max_tokens, repeats=repeats, threads=args.threads,
                      bandwidth=bandwidth, results=results,
                      **({"streams": args.streams, "stream_prompt_len": args.stream_prompt_len,
                          "stream_temperature": args.stream_temperature} if moe else {}))
    c.finish(name, title, result, render_fn, args.no_doc)


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


# Issue 45's targets (set for the Qwen3-30B-A3B shape): (what, the Loom row's value of a
# size's result, bound, whether the value must be at least the bound, else at most).
MOE_TARGETS: list[tuple[str, Any, float, bool]] = [
    ("decode, one stream, over llama.cpp's", lambda r: r.get("decode_over_llama_cpp"), 1.3,
     True),
    ("8 streams' total decode tok/s over one stream's",
     lambda r: r.get("streams_over_one_stream"), 3.0, True),
    ("TTFT (512) over llama.cpp's", lambda r: r.get("ttft_over_llama_cpp"), 0.8, False),
    ("peak RSS (warm process after the run) over llama.cpp's",
     lambda r: r.get("run_rss_over_llama_cpp"), 1.1, False),
    ("first load over the time to read the file from disk",
     lambda r: r.get("first_load_over_cold_read"), 2.0, False),
]
# gpt-oss-20b's targets: decode, TTFT and peak RSS against llama.cpp, the same bounds.
GPT_OSS_TARGETS = [MOE_TARGETS[0], MOE_TARGETS[2], MOE_TARGETS[3]]


def targets_of(per_size: dict[str, Any]) -> list[tuple[str, Any, float, bool]]:
    """The targets a mixture-of-experts size's Loom rows are held to."""
    return GPT_OSS_TARGETS if per_size["moe"]["arch"] == "gpt-oss" else MOE_TARGETS


def _targets_heading(result: dict[str, Any]) -> str:
    """What the targets table holds, by the shapes in the result."""
    archs = {s["moe"]["arch"] for s in result["results"].values()}
    parts = []
    if archs - {"gpt-oss"}:
        others = [name for arch, name in (("llama", "Mixtral"), ("olmoe", "OLMoE"))
                  if arch in archs]
        parts.append("Issue 45's targets (set for the Qwen3-30B-A3B shape"
                     + (f"; the {' and '.join(others)} rows are measured against the same"
                        " bounds for reference" if others else "") + ")")
    if "gpt-oss" in archs:
        parts.append("the targets for gpt-oss-20b (decode at least 1.3x llama.cpp's, TTFT "
                     "(512) at most 0.8x, peak RSS at most 1.1x)")
    heading = " and ".join(parts)
    return heading[0].upper() + heading[1:]


def _tokenizer_note(result: dict[str, Any]) -> str:
    """Which vocabulary the files carry, for the notes."""
    note = ("The tokenizer (and so the embedding and output head) is SmolLM2's 49,152 tokens, "
            "not the model's own")
    if any(s["moe"]["arch"] == "gpt-oss" for s in result["results"].values()):
        note += (", except gpt-oss-20b's: the model's real 201,088 (SmolLM2's tokens padded "
                 "to that size), so its output head reads the real bytes a token")
    return note + ". "


def render_moe(result: dict[str, Any]) -> str:
    """The mixtures of experts' doc section: speed, loads and memory, and the targets."""
    speed, loads, targets = [], [], []
    n = result.get("streams", 8)
    for size, per_size in result["results"].items():
        moe = per_size["moe"]
        model = f"{size} ({moe['layer_cut']})"
        cold = moe["cold_read"]
        for label, r in per_size["engines"].items():
            streams = r.get("streams") or {}
            speed.append([
                model, label, r["decode_tok_s"], streams.get("decode_total_tok_s"),
                r.get("streams_over_one_stream"), streams.get("overall_tok_s"), r["ttft_ms"],
                r["read_bytes_per_token"] / GIB, r["limit_tok_s"], r["decode_share_of_limit"],
                r.get("decode_over_llama_cpp"), r.get("streams_over_llama_cpp"),
                r.get("ttft_over_llama_cpp"),
            ])
            prepared = r.get("prepared_bytes")
            loads.append([
                model, label, per_size["file_bytes"] / GIB, cold["s"], r["first_load_s"],
                r.get("first_load_over_cold_read"), r.get("warm_load_s"),
                r["first_load_rss_gib"], r.get("warm_load_rss_gib"), r["run_peak_rss_gib"],
                r.get("streams_peak_rss_gib"),
                None if prepared is None else prepared / GIB,
                r.get("run_rss_over_llama_cpp"),
            ])
            if label == "llama.cpp":
                continue
            for what, value_of, bound, at_least in targets_of(per_size):
                value = value_of(r)
                met = None if value is None else (value >= bound if at_least else value <= bound)
                targets.append([model, label, what, f"{'≥' if at_least else '≤'} {bound}",
                                value, {None: "not measured", True: "met",
                                        False: "not met"}[met]])
    speed_table = c.markdown_table(
        ["model", "engine", "decode tok/s (1 stream)", f"{n} streams: total decode tok/s",
         f"{n} streams / 1", f"{n} streams: tok/s with prefills",
         f"TTFT ms ({result['prompt_len']})", "read/token GiB", "limit tok/s",
         "decode / limit", "decode Loom/llama.cpp", f"{n} streams Loom/llama.cpp",
         "TTFT Loom/llama.cpp"], speed)
    load_table = c.markdown_table(
        ["model", "engine", "file GiB", "cold read s", "first load s",
         "first load / cold read", "warm load s", "first load peak RSS GiB",
         "warm load peak RSS GiB", "peak RSS after run GiB", f"peak RSS after {n} streams GiB",
         "prepared GiB", "peak RSS Loom/llama.cpp"], loads)
    target_table = c.markdown_table(["model", "engine", "target", "bound", "measured", ""],
                                    targets)
    bw = result["bandwidth"]
    files = "".join(
        f"\n- {size}: {s.get('written', '?')}, {s['file_bytes'] / GIB:.2f} GiB; "
        f"{s['moe']['experts']} experts, {s['moe']['experts_used']} a token, expert width "
        f"{s['moe']['expert_ffn']}; vocabulary {s['moe']['vocab']:,} "
        f"({s['moe'].get('tokenizer', SMOLLM2_TOKENIZER)}); "
        f"cold read {s['moe']['cold_read']['s']:.1f} s ({s['moe']['cold_read']['gb_s']:.2f} "
        f"GB/s, page cache dropped: {s['moe']['cold_read']['page_cache_dropped']})"
        for size, s in result["results"].items())
    return (
        f"Speed:\n\n{speed_table}\n\nLoads and memory:\n\n{load_table}\n\n"
        f"{_targets_heading(result)}:\n\n{target_table}\n\n"
        f"Files:\n{files}\n\n"
        "Each layer has its model's real sizes; only the layer count is cut (\"N of M "
        "layers\"), so a decode step's per-layer work is the real one and the whole-model "
        "figures (tok/s, TTFT, file, memory) are those of the cut model. "
        f"{_tokenizer_note(result)}"
        f"Read bandwidth {bw['gb_s']:.1f} GB/s (`torch.ones(N).sum()` over {bw['mib']} MiB, "
        f"{bw['threads']} threads, best of 5, in this run); limit tok/s = bandwidth / bytes "
        "read per token, where a token reads the attention, router, norms and output head in "
        "full and experts_used / experts of every expert tensor (for llama.cpp the GGUF's "
        "bytes, for Loom its prepared tensors). The probe is a torch reduction on 2 "
        "threads, not the most this host's memory gives: a decode / limit above 1 means the "
        "engine read its bytes faster than the probe did. "
        f"{n} streams: {n} requests of {result.get('stream_prompt_len', '?')}-token prompts "
        f"submitted at once, {result['max_tokens']} tokens each, sampled at temperature "
        f"{result.get('stream_temperature', 0):g} with a seed (0: greedy). Greedy decoding of "
        "random weights can fall into one token repeated in every stream, whose steps would "
        "then share their experts: sampled streams make different tokens and so route as "
        "real text does, each step reading the union of the streams' experts (the "
        "one-stream rows are greedy: one stream reads the same bytes a token either way). "
        "Total decode tok/s "
        "counts the tokens made after every stream has its first token, over the time from "
        "then to the last token (\"with prefills\" divides every token by the time from "
        "submission). Loom runs them in one engine (`add_request` eight times, then `step`); "
        "llama.cpp in one context with `n_seq_max` = 8 through llama-cpp-python's low-level "
        "API (`llama_batch` with one token of every sequence per `llama_decode`, its own "
        "sampler chain: temperature, then `dist`), as its `batched` example and its "
        "server's parallel slots run them. The one-stream decode follows a 512-token prompt, "
        "the streams' a short one. "
        "Cold read: the page cache dropped (`sync; echo 3 > /proc/sys/vm/drop_caches`, as "
        "root), then the file read once in 16 MiB reads (as `cat file > /dev/null`). Each "
        "engine's first load starts with the page cache dropped the same way, so it reads "
        "the file from disk: Loom's also has an empty prepared-weights cache and writes it "
        "(\"prepared GiB\"); llama.cpp maps the file with MAP_POPULATE. Each warm load is a "
        "fresh process with the file (and Loom's prepared cache) in the page cache, and it "
        "runs the measurements; peak RSS is the process's VmHWM (imports included; mapped "
        "file pages count once read). Decode Loom/llama.cpp above 1 and TTFT Loom/llama.cpp "
        f"below 1 favour Loom.{_separate_runs(result)}{c.skip_notes_md(result)}"
    )


if __name__ == "__main__":
    main()
