"""Start-up: how long a fresh process takes to load the model and answer, and its peak memory.

Every `loom generate` and every `loom serve` restart pays this. Each system runs in a fresh
Python process per repeat, which times its own phases and reports its peak resident memory
(VmHWM, its own high-water mark, so every byte ever resident counts, even briefly;
`ru_maxrss` where /proc is missing, which can carry the launching process's mark):

- imports: the library's own import (`import loom` with its engine modules and torch,
  `import llama_cpp`, `import torch, transformers`);
- load: constructing the model object (`LLM(model=...)`, `Llama(model_path=...)`,
  `AutoModelForCausalLM.from_pretrained(gguf_file=...)` + its tokenizer);
- first token: one greedy token for a short prompt;
- process: wall time from launching the interpreter to the first token, measured outside.

Loom runs twice: "cold" with an empty cache directory (`LOOM_CACHE_DIR`: the prepared
weights, the converted tokenizer and the kernels are all built), then "warm" (what every later
start sees). The "warm" figures are the issue's targets: load at most 2 s, peak RSS at most
1.5 GB. llama.cpp opens the same GGUF file; transformers dequantises it.
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any

import common as c

NAME = "startup"
TITLE = "Start-up: time to load and first token, peak memory, in a fresh process"
PROMPT = "The capital of France is"

# Each child prints one JSON line: {"imports_s", "load_s", "first_token_s", "peak_rss_mb"}.
_CHILD_PRELUDE = """
import json, resource, sys, time
t0 = time.perf_counter()
"""
_CHILD_EPILOGUE = """
t3 = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
try:  # VmHWM: this process's own high-water mark (ru_maxrss can carry the parent's)
    peak = [int(line.split()[1]) / 1024 for line in open("/proc/self/status")
            if line.startswith("VmHWM:")][0]
except (OSError, IndexError):
    pass
print("RESULT " + json.dumps({"imports_s": t1 - t0, "load_s": t2 - t1,
      "first_token_s": t3 - t2, "peak_rss_mb": peak, "text": text}), flush=True)
"""
_LOOM = """
import loom
import loom.engine.llm  # torch and the engine (`import loom` alone defers them)
t1 = time.perf_counter()
llm = loom.LLM(model={model!r}, dtype={dtype!r}, quantization={quantization!r})
t2 = time.perf_counter()
out = llm.generate([{prompt!r}], loom.SamplingParams(temperature=0.0, max_tokens=1))
text = out[0].outputs[0].text
"""
_LLAMA_CPP = """
import llama_cpp
t1 = time.perf_counter()
llm = llama_cpp.Llama(model_path={path!r}, n_ctx=2048, n_threads={threads}, verbose=False)
t2 = time.perf_counter()
text = llm({prompt!r}, max_tokens=1, temperature=0.0)["choices"][0]["text"]
"""
_HF = """
import torch, transformers
t1 = time.perf_counter()
tok = transformers.AutoTokenizer.from_pretrained({folder!r}, gguf_file={name!r})
model = transformers.AutoModelForCausalLM.from_pretrained({folder!r}, gguf_file={name!r},
                                                          torch_dtype=torch.bfloat16)
t2 = time.perf_counter()
ids = tok({prompt!r}, return_tensors="pt").input_ids
with torch.inference_mode():
    new = model.generate(ids, max_new_tokens=1, do_sample=False)
text = tok.decode(new[0, ids.shape[1]:])
"""


def run_child(body: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One fresh process: its own phase times and peak RSS, plus the wall time seen outside."""
    return c.run_result_child([sys.executable, "-c", _CHILD_PRELUDE + body + _CHILD_EPILOGUE],
                              env=env)


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of every figure over the runs, and the runs themselves."""
    keys = ("imports_s", "load_s", "first_token_s", "process_s", "peak_rss_mb")
    return {**{k: c.median([r[k] for r in runs]) for k in keys}, "text": runs[0]["text"],
            "runs": runs}


def main() -> None:
    parser = c.base_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    if args.doc_only:
        c.rerender(NAME, TITLE, render)
        return
    repeats = args.repeats or (2 if args.quick else 3)
    path = c.model_path(args.model)
    quantization = None if args.quantization == "none" else args.quantization
    systems: dict[str, dict[str, Any]] = {}

    loom_body = _LOOM.format(model=args.model, dtype=args.dtype, quantization=quantization,
                             prompt=PROMPT)
    with tempfile.TemporaryDirectory(prefix="loom-startup-") as cache:
        env = {"LOOM_CACHE_DIR": cache}
        c.log("loom cold (empty LOOM_CACHE_DIR) ...")
        systems["Loom (cold cache)"] = summarise([run_child(loom_body, env)])
        runs = []
        for i in range(repeats):
            runs.append(run_child(loom_body, env))
            c.log(f"loom warm {i + 1}/{repeats}: load {runs[-1]['load_s']:.2f} s, "
                  f"peak {runs[-1]['peak_rss_mb']:.0f} MB")
        systems["Loom"] = summarise(runs)

    if args.no_llama_cpp:
        c.skip("llama.cpp: --no-llama-cpp")
    else:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            c.skip("llama.cpp: llama-cpp-python not installed (pip install -e '.[bench]')")
        else:
            body = _LLAMA_CPP.format(path=str(path), threads=args.threads, prompt=PROMPT)
            runs = [run_child(body) for _ in range(repeats)]
            systems["llama.cpp"] = summarise(runs)
            c.log(f"llama.cpp: load {systems['llama.cpp']['load_s']:.2f} s")

    if args.no_hf:
        c.skip("transformers: --no-hf")
    else:
        body = _HF.format(folder=str(path.parent), name=path.name, prompt=PROMPT)
        try:
            systems["transformers bf16"] = summarise([run_child(body)])
        except RuntimeError as exc:
            c.skip(f"transformers: {str(exc)[-300:]}")

    result = c.header(NAME, args, dtype=args.dtype, quantization=args.quantization,
                      repeats=repeats, systems=systems,
                      sizes_note=f"{repeats} warm starts per system (median); one cold Loom "
                                 "start; prompt of 6 tokens, 1 greedy token")
    c.finish(NAME, TITLE, result, render, args.no_doc)


def render(result: dict[str, Any]) -> str:
    """The doc section: one row per system, and the two targets."""
    systems = result["systems"]
    rows = [
        [name, s["imports_s"], s["load_s"], s["first_token_s"], s["process_s"],
         s["peak_rss_mb"]]
        for name, s in systems.items()
    ]
    table = c.markdown_table(
        ["system", "imports s", "load s", "first token s", "process to first token s",
         "peak RSS MB"], rows,
    )
    loom = systems.get("Loom")
    lines = [table]
    if loom:
        lines.append(
            f"\nTargets for a warm Loom start: load at most 2 s (measured "
            f"{loom['load_s']:.2f} s: {'met' if loom['load_s'] <= 2 else 'not met'}), peak "
            f"RSS at most 1,536 MB (measured {loom['peak_rss_mb']:,.0f} MB: "
            f"{'met' if loom['peak_rss_mb'] <= 1536 else 'not met'})."
        )
        peer = systems.get("llama.cpp")
        if peer:
            load = c.fmt(c.ratio(loom["load_s"], peer["load_s"]))
            lines.append(f"Loom / llama.cpp: load {load}x, process to first token "
                         f"{c.fmt(c.ratio(loom['process_s'], peer['process_s']))}x, peak RSS "
                         f"{c.fmt(c.ratio(loom['peak_rss_mb'], peer['peak_rss_mb']))}x.")
    return "\n".join(lines) + c.skip_notes_md(result)


if __name__ == "__main__":
    main()
