"""Speculative decoding on prompts without a repeated passage: n-gram drafts against plain decode.

The latency benchmark's prompts repeat one paragraph, so its continuation copies the prompt
and n-gram drafts are nearly always right. Here every prompt is a short instruction (a
story, facts, code, an extraction) and each engine generates `--max-tokens` tokens (EOS
ignored), greedily and by seeded sampling at temperature 0.8. Loom runs one mode (default
w8a8+kv16) without and with "+ngram" in the same process; we report tokens/s over the whole
request (the short prompts' prefill included), the speedup, the share of drafts accepted, and
whether the tokens are identical (they must be). HF transformers bf16 runs the same greedy
requests without and with its prompt-lookup decoding, as the peer.
"""

from __future__ import annotations

from typing import Any

import common as c

NAME = "speculative"
TITLE = "Speculative decoding (n-gram) on prompts without a repeated passage"

PROMPTS = {
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "facts": "List five facts about the planet Mars.",
    "code": "def merge_sort(values):\n    \"\"\"Sort a list of numbers with merge sort.\"\"\"\n",
    "extract": "Meeting notes: Anna will send the budget on Monday. Ben will book the venue by "
               "Friday. Chloe will draft the agenda by Wednesday.\nList each person and their "
               "task:\n",
}
TEMPERATURES = (0.0, 0.8)


def loom_time(engine: Any, ids: list[int], temperature: float, max_tokens: int,
              repeats: int) -> tuple[float, list[int]]:
    """Best wall time of one request over `repeats` (after a warm-up), and its tokens."""
    from loom import SamplingParams

    params = SamplingParams(temperature=temperature, seed=1, max_tokens=max_tokens,
                            ignore_eos=True)
    tokens: list[int] = []

    def run() -> None:
        nonlocal tokens
        engine.add_request("spec-bench", ids, params)
        last = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                last = out
        tokens = last.outputs[0].token_ids

    timing = c.time_call(run, warmup=1, repeats=repeats)
    return timing["min_s"], tokens


def hf_time(hf: Any, ids: list[int], max_tokens: int, lookup: int | None) -> float:
    """Wall time of HF greedy `generate` (prompt lookup with `lookup` drafts if given)."""
    import torch

    extra = {} if lookup is None else {"prompt_lookup_num_tokens": lookup}
    input_ids = torch.tensor([ids])

    def run() -> None:
        with torch.inference_mode():
            hf.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                        max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                        top_p=None, top_k=None, pad_token_id=c.hf_pad_id(hf), **extra)

    return c.time_call(run, warmup=0, repeats=1)["min_s"]


def main() -> None:
    """Run plain and n-gram Loom (and HF bf16 with and without prompt lookup) on each prompt."""
    parser = c.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--mode", default="w8a8+kv16", help="Loom variant to speed up")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per request (128)")
    args = parser.parse_args()
    if args.doc_only:
        return c.rerender(NAME, TITLE, render)
    max_tokens = args.max_tokens or (32 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 2)
    plain = c.try_variant_engine(args, args.mode)
    spec = c.try_variant_engine(args, f"{args.mode}+ngram")
    if plain is None or spec is None:
        raise SystemExit("Loom engines could not be built")
    tok = plain.tokenizer
    prompts = {name: tok.encode(text) for name, text in PROMPTS.items()}
    rows: list[dict[str, Any]] = []
    for temperature in TEMPERATURES:
        for name, ids in prompts.items():
            c.log(f"loom {args.mode} +/- ngram: {name}, temperature {temperature}")
            t_plain, tokens_plain = loom_time(plain, ids, temperature, max_tokens, repeats)
            drafted, accepted = spec.speculator.num_drafted, spec.speculator.num_accepted
            t_spec, tokens_spec = loom_time(spec, ids, temperature, max_tokens, repeats)
            drafted = spec.speculator.num_drafted - drafted
            rows.append({
                "prompt": name, "temperature": temperature,
                "plain_tok_s": round(max_tokens / t_plain, 2),
                "ngram_tok_s": round(max_tokens / t_spec, 2),
                "speedup": round(t_plain / t_spec, 3),
                "acceptance": round((spec.speculator.num_accepted - accepted) / drafted, 3)
                if drafted else None,
                "identical": tokens_plain == tokens_spec,
            })
    peer: dict[str, dict[str, float]] = {}
    hf = None if args.no_hf else c.load_hf(args.model, "bfloat16")
    if hf is None and not args.no_hf:
        c.skip("transformers bfloat16: skipped (not installed)")
    if args.no_hf:
        c.skip("transformers: skipped (--no-hf)")
    if hf is not None:
        hf_time(hf, prompts["story"], 8, None)  # warm-up (first-call costs), untimed
        for name, ids in prompts.items():
            c.log(f"transformers bfloat16 +/- prompt lookup: {name}")
            peer[name] = {
                "hf_bf16_tok_s": round(max_tokens / hf_time(hf, ids, max_tokens, None), 2),
                "hf_bf16_lookup_tok_s": round(max_tokens / hf_time(hf, ids, max_tokens, 4), 2),
            }
    for row in rows:
        if row["temperature"] == 0.0 and row["prompt"] in peer:
            row.update(peer[row["prompt"]])
            row["ngram_over_hf_bf16"] = c.ratio(row["ngram_tok_s"], row["hf_bf16_tok_s"])
            row["ngram_over_hf_lookup"] = c.ratio(row["ngram_tok_s"],
                                                  row["hf_bf16_lookup_tok_s"])
    sizes = f"{len(prompts)} prompts x {max_tokens} tokens, best of {repeats}"
    result = c.header(NAME, args, dtype=args.mode, sizes_note=sizes, max_tokens=max_tokens,
                      rows=rows)
    c.finish(NAME, TITLE, result, render, args.no_doc)


def render(result: dict[str, Any]) -> str:
    """One row per prompt and temperature."""
    mode = result["dtype"]
    table = c.markdown_table(
        ["prompt", "temperature", f"loom {mode} tok/s", "+ngram tok/s", "speedup",
         "drafts accepted", "same tokens", "transformers bf16 tok/s", "+prompt lookup tok/s",
         "ngram / bf16", "ngram / bf16 lookup"],
        [[r["prompt"], r["temperature"], r["plain_tok_s"], r["ngram_tok_s"], r["speedup"],
          r["acceptance"], "yes" if r["identical"] else "NO", r.get("hf_bf16_tok_s"),
          r.get("hf_bf16_lookup_tok_s"), r.get("ngram_over_hf_bf16"),
          r.get("ngram_over_hf_lookup")] for r in result["rows"]],
    )
    notes = c.skip_notes_md(result)
    return (f"{table}\n\nTokens/s over the whole request (prefill of the short prompt "
            f"included). transformers runs greedy only (its prompt lookup does not sample).{notes}")


if __name__ == "__main__":
    main()
