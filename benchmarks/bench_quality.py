"""Quality of the quantised modes against float32 on the same weights (decode path).

For each mode (float32, then every `--modes` entry) the same fixed text is fed one token per
step, exactly as decoding does, and we record the perplexity of the text and how often the
mode's top-1 next token equals float32's (teacher-forced agreement). Then every prompt of a
fixed set is continued greedily and we count the share of generated tokens identical to
float32's at the same position, and how many tokens stay identical before the first change.
"""

from __future__ import annotations

import math
from typing import Any

import common as c
import torch

NAME = "quality"
TITLE = "Quality: quantised modes against float32"

TEXT = (
    "The river town woke slowly. Bakers pulled the first loaves from their ovens while the "
    "ferry captain checked the ropes and the weather. Children ran along the embankment with "
    "kites that refused to fly, and an old man sold newspapers that nobody wanted to read. By "
    "noon the market was full: farmers argued about the price of apples, a musician played "
    "the same three songs for coins, and the smell of roasted chestnuts drifted between the "
    "stalls. In the evening the lamps came on one by one, the boats returned with empty nets, "
    "and the town settled into the quiet rhythm it had known for a hundred years."
)
PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):\n",
    "Water boils at a temperature of",
    "The three primary colours are",
    "In 1969, the first humans",
    "A good recipe for pancakes needs",
    "The most important rule of programming is",
]


def teacher_forced_logits(engine: Any, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] computed one token per step over the engine's (idle) KV cache."""
    from loom.attention import forward_context
    from loom.core.scheduler_output import ScheduledChunk

    runner = engine.runner
    blocks = list(range(-(-len(ids) // runner.block_size)))
    rows = []
    for pos, tok in enumerate(ids):
        chunk = ScheduledChunk("quality", [tok], pos, blocks, True)
        metadata = runner.build_metadata([chunk])
        with torch.inference_mode(), forward_context(metadata, runner.kv_caches, runner.backend):
            hidden = runner.model(torch.tensor([tok]), metadata.positions)
            rows.append(runner.model.compute_logits(hidden)[0])
    return torch.stack(rows)


def greedy(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations (EOS ignored) of every prompt."""
    from loom import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"q{i}", prompt, params)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = list(out.outputs[0].token_ids)
    return [outs[f"q{i}"] for i in range(len(prompts))]


def evaluate(engine: Any, text_ids: list[int], prompts: list[list[int]], max_tokens: int,
             ref: dict[str, Any] | None) -> dict[str, Any]:
    """Perplexity and top-1 of the text; greedy continuations; agreement with `ref`."""
    logits = teacher_forced_logits(engine, text_ids)
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
    targets = torch.tensor(text_ids[1:])
    nll = -logprobs.gather(1, targets[:, None]).mean().item()
    top1 = logits[:-1].argmax(-1)
    outs = greedy(engine, prompts, max_tokens)
    row: dict[str, Any] = {"perplexity": round(math.exp(nll), 4), "top1": top1.tolist(),
                           "greedy": outs}
    if ref is not None:
        row["top1_agreement"] = round((top1 == torch.tensor(ref["top1"])).float().mean().item(), 4)
        same = sum(a == b for o, r in zip(outs, ref["greedy"], strict=True)
                   for a, b in zip(o, r, strict=True))
        row["greedy_identical_share"] = round(same / sum(len(o) for o in outs), 4)
        prefix = []
        for o, r in zip(outs, ref["greedy"], strict=True):
            n = next((i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b), len(o))
            prefix.append(n)
        row["tokens_before_first_change"] = prefix
    return row


def main() -> None:
    """Run float32 and each quantised mode on the same text and prompts."""
    parser = c.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["int8", "w8a8", "w8a8+kv16"])
    parser.add_argument("--max-tokens", type=int, default=None, help="greedy length (32)")
    args = parser.parse_args()
    if args.doc_only:
        return c.rerender(NAME, TITLE, render)
    max_tokens = args.max_tokens or (16 if args.quick else 32)
    prompts_text = PROMPTS[:4] if args.quick else PROMPTS
    results: dict[str, dict[str, Any]] = {}
    ref: dict[str, Any] | None = None
    for mode in ["float32", *args.modes]:
        c.log(f"loom {mode}")
        if mode == "float32":
            engine = c.make_engine(args, dtype="float32", quantization=None)
        else:
            engine = c.try_variant_engine(args, mode)
            if engine is None:
                continue
        tok = engine.tokenizer
        text_ids = tok.encode(TEXT, add_special_tokens=True)
        prompts = [tok.encode(p, add_special_tokens=True) for p in prompts_text]
        results[mode] = evaluate(engine, text_ids, prompts, max_tokens, ref)
        if ref is None:
            ref = results[mode]
        del engine
    sizes = (f"text of {len(text_ids)} tokens one per step; {len(prompts_text)} prompts x "
             f"{max_tokens} greedy tokens")
    result = c.header(NAME, args, dtype="float32 reference", sizes_note=sizes,
                      max_tokens=max_tokens, results=results)
    c.finish(NAME, TITLE, result, render, args.no_doc)


def render(result: dict[str, Any]) -> str:
    """One row per mode: perplexity, agreement with float32."""
    rows = []
    for mode, r in result["results"].items():
        rows.append([mode, r["perplexity"], r.get("top1_agreement"),
                     r.get("greedy_identical_share"),
                     " ".join(str(n) for n in r.get("tokens_before_first_change", [])) or None])
    table = c.markdown_table(
        ["mode", "perplexity", "top-1 = float32 (teacher-forced)",
         "greedy tokens identical", "tokens before first change (per prompt)"],
        rows,
    )
    return (f"{table}\n\nint8: weight-only int8 (per-channel), float32 activations; w8a8: int8 "
            "weights and activations rounded to int8 per block of 32 in the decode kernel; "
            "+kv16: the KV cache stored in float16.")


if __name__ == "__main__":
    main()
