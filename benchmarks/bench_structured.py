"""Constrained decoding's cost per token: a JSON schema against unconstrained decoding.

Three measurements, in one run:
1. the grammar libraries alone on the model's vocabulary: mask time per token of
   llguidance (what Loom uses) and xgrammar (when installed), walking one JSON document;
2. Loom's single-stream decode tok/s with the schema against without (greedy, EOS ignored
   for the unconstrained run; the constrained run stops when its document is complete, so
   tok/s counts its tokens), and batched throughput with 16 constrained rows against 16
   unconstrained;
3. llama.cpp's grammar support (`LlamaGrammar.from_json_schema`) on the same GGUF, with and
   without the grammar, when llama-cpp-python is installed.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import common as c

NAME = "structured"
TITLE = "Structured output: decode speed with a JSON schema"



def _people_schema(max_length: int | None) -> dict[str, Any]:
    """Six records (name, age, city): documents long enough to time. `max_length` bounds
    the strings (a costly constraint for a mask: every token's length counts)."""
    text: dict[str, Any] = {"type": "string"}
    if max_length is not None:
        text["maxLength"] = max_length
    return {"type": "object", "required": ["people"], "additionalProperties": False,
            "properties": {"people": {
                "type": "array", "minItems": 6, "maxItems": 6, "items": {
                    "type": "object", "required": ["name", "age", "city"],
                    "additionalProperties": False,
                    "properties": {"name": text, "city": text,
                                   "age": {"type": "integer", "minimum": 0, "maximum": 120}}}}}}


# What decoding is timed with (as a pydantic model's schema reads), and a bounded variant
# the mask table also reports.
SCHEMA = _people_schema(None)
BOUNDED_SCHEMA = _people_schema(12)
DOCUMENT = {"people": [{"name": f"Person {i}", "age": 20 + i, "city": "Lisbon"}
                       for i in range(6)]}
PROMPT = "Here is a list of six people as JSON, with names, ages and cities:\n"


def library_mask_times(tokenizer: Any, vocab_size: int, schema: dict[str, Any]
                       ) -> dict[str, Any]:
    """Per-token mask time of each library walking DOCUMENT's tokens under `schema`
    (microseconds), after one warm-up walk of the same document."""
    backend = tokenizer.backend
    text = json.dumps(DOCUMENT, separators=(",", ":"))
    ids = backend.encode(text, add_special_tokens=False).ids
    out: dict[str, Any] = {"tokens": len(ids)}
    import llguidance as llg
    import torch

    start = time.perf_counter()
    lltok = llg.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                            eos_token=sorted(tokenizer.eos_token_ids))
    build = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llg.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_flexible": False})
    matcher = llg.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - start
    mask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
    for token in ids:  # a first walk fills the library's caches; a fresh matcher is timed
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        matcher.consume_token(token)
    matcher = llg.LLMatcher(lltok, grammar)
    times = []
    for token in ids:
        start = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        times.append(time.perf_counter() - start)
        matcher.consume_token(token)
    out["llguidance"] = _summary(build, compile_s, times)
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError as error:
        out["xgrammar"] = f"not installed ({error})"
        return out
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=backend),
                                              vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info)
    build = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                            separators=(",", ":"))
    compile_s = time.perf_counter() - start
    xmatcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    for token in ids:  # as above: a warm-up walk, then a fresh matcher is timed
        xmatcher.fill_next_token_bitmask(bitmask, 0)
        xmatcher.accept_token(token)
    xmatcher = xgr.GrammarMatcher(compiled)
    times = []
    for token in ids:
        start = time.perf_counter()
        xmatcher.fill_next_token_bitmask(bitmask, 0)
        times.append(time.perf_counter() - start)
        xmatcher.accept_token(token)
    out["xgrammar"] = _summary(build, compile_s, times)
    return out


def _summary(build_s: float, compile_s: float, times: list[float]) -> dict[str, Any]:
    times = sorted(times)
    return {"tokenizer_s": round(build_s, 2), "compile_ms": round(compile_s * 1e3, 2),
            "mask_us_median": round(statistics.median(times) * 1e6, 1),
            "mask_us_p90": round(times[int(0.9 * len(times))] * 1e6, 1),
            "mask_us_mean": round(statistics.mean(times) * 1e6, 1)}


def loom_decode(engine: Any, batch: int, constrained: bool, max_tokens: int) -> dict[str, Any]:
    """Output tok/s of `batch` greedy requests after their prompt (decode steps only)."""
    from loom import SamplingParams, StructuredOutputsParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=not constrained,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA)
                            if constrained else None)
    for i in range(batch):
        engine.add_request(f"r{i}", PROMPT + " " * i, params)
    first: float | None = None
    tokens, last = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
            if first is None and any(o.token_ids for o in out.outputs):
                first = time.perf_counter()  # the prefill is done: time decode only
    end = time.perf_counter()
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in last.values())
    parsed = 0
    if constrained:
        for o in last.values():
            try:
                json.loads(o.outputs[0].text)
                parsed += 1
            except json.JSONDecodeError:
                pass
    assert first is not None
    return {"tok_s": round(tokens / (end - first), 1), "tokens": tokens,
            "parsed": parsed if constrained else None}


def llama_cpp_decode(args: Any, constrained: bool, max_tokens: int) -> dict[str, Any] | None:
    """llama.cpp single-stream tok/s with and without its JSON-schema grammar."""
    llm = c.load_llama_cpp(args.model, n_ctx=1024, threads=args.threads,
                           disabled=args.no_llama_cpp)
    if llm is None:
        return None
    from llama_cpp import LlamaGrammar

    grammar = LlamaGrammar.from_json_schema(json.dumps(SCHEMA)) if constrained else None
    start = time.perf_counter()
    out = llm(PROMPT, max_tokens=max_tokens, temperature=0.0, grammar=grammar)
    elapsed = time.perf_counter() - start
    tokens = out["usage"]["completion_tokens"]
    return {"tok_s": round(tokens / elapsed, 1), "tokens": tokens, "includes_prefill": True}


def main() -> None:
    """Run the three measurements and report."""
    parser = c.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="rows of the batched run")
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    # One section per model: the default model's, and e.g. the instruct model's.
    name = NAME if args.model == c.DEFAULT_MODEL else f"{NAME}_{args.model}"
    title = TITLE if args.model == c.DEFAULT_MODEL else f"{TITLE} ({args.model})"
    if args.doc_only:
        return c.rerender(name, title, render)
    engine = c.make_engine(args, max_num_seqs=max(args.batch, 1))
    result = c.header(NAME, args, dtype=engine.config.dtype,
                      sizes_note=f"a 6-record JSON schema, greedy, max_tokens {args.max_tokens}, "
                                 f"batch 1 and {args.batch}")
    result["libraries"] = {
        name: library_mask_times(engine.tokenizer, engine.config.vocab_size, schema)
        for name, schema in (("strings unbounded", SCHEMA),
                             ("strings maxLength 12", BOUNDED_SCHEMA))}
    c.log(f"libraries: {result['libraries']}")
    loom_decode(engine, 1, True, 8)  # warm up: the grammar library reads the vocabulary
    rows = {}
    for batch in (1, args.batch):
        for constrained in (False, True):
            key = f"batch{batch}_{'schema' if constrained else 'free'}"
            rows[key] = loom_decode(engine, batch, constrained, args.max_tokens)
            c.log(f"{key}: {rows[key]}")
    result["loom"] = rows
    for batch in (1, args.batch):
        free, schema = rows[f"batch{batch}_free"], rows[f"batch{batch}_schema"]
        rows[f"batch{batch}_ratio"] = c.ratio(schema["tok_s"], free["tok_s"])
    llama = {name: llama_cpp_decode(args, constrained, args.max_tokens)
             for name, constrained in (("free", False), ("schema", True))}
    result["llama_cpp"] = llama
    c.finish(name, title, result, render, args.no_doc)


def render(result: dict[str, Any]) -> str:
    """The doc section."""
    libs = result["libraries"]
    lib_rows = [(f"{name} ({schema})", v["tokenizer_s"], v["compile_ms"], v["mask_us_median"],
                 v["mask_us_p90"], v["mask_us_mean"])
                for schema, by_lib in libs.items()
                for name, v in by_lib.items() if isinstance(v, dict)]
    num_tokens = next(iter(libs.values()))["tokens"]
    loom = result["loom"]
    batch = next(int(k[5:].split("_")[0]) for k in loom if k.startswith("batch")
                 and not k.startswith("batch1_"))
    loom_rows = [(f"Loom, batch {b}", loom[f"batch{b}_free"]["tok_s"],
                  loom[f"batch{b}_schema"]["tok_s"], loom[f"batch{b}_ratio"],
                  f"{loom[f'batch{b}_schema']['parsed']}/{b}") for b in (1, batch)]
    llama = result.get("llama_cpp") or {}
    if llama.get("free") and llama.get("schema"):
        loom_rows.append(("llama.cpp (incl. prefill), batch 1", llama["free"]["tok_s"],
                          llama["schema"]["tok_s"],
                          c.ratio(llama["schema"]["tok_s"], llama["free"]["tok_s"]), "—"))
    return "\n\n".join([
        c.markdown_table(["library (schema)", "vocabulary read (s)", "schema compile (ms)",
                          "mask µs/token median", "p90", "mean"], lib_rows),
        c.markdown_table(["engine", "free tok/s", "JSON schema tok/s", "ratio",
                          "documents that parse"], loom_rows),
        f"Mask times walk one {num_tokens}-token document over the model's vocabulary. "
        "Decode tok/s count output tokens after the prompt, with the unbounded schema (as a "
        "pydantic model's reads); the constrained runs stop when the document is complete. "
        "On a CPU a step's masks are computed after the forward, in parallel over the rows: "
        "computing them on a thread during the forward made the 16-row step 1.2x slower "
        "here (the forward already uses every core); on a GPU they are computed during the "
        "forward, while the host is idle (unmeasured: no GPU was at hand).",
    ])


if __name__ == "__main__":
    main()
