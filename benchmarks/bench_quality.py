"""Quality of the quantised modes against float32 on the same weights.

For each mode (float32, then every `--modes` entry) the same fixed text (four paragraphs of
different kinds, about 450 tokens) is fed one token per step, exactly as decoding does, and
we record the perplexity of the text and how often the mode's top-1 next token equals
float32's (teacher-forced agreement). The text is also computed as one prompt (the prefill
path: large matmuls, in bf16 on hosts where the mode chooses it) for a second perplexity.
Then every prompt of a fixed set is continued greedily and we count the share of generated
tokens identical to float32's at the same position, and how many tokens stay identical
before the first change. llama.cpp runs the same token ids on the same file (its own
quantised arithmetic: the peer's quality on this file), one prompt for the text's
perplexity, and the same greedy continuations.
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
    "and the town settled into the quiet rhythm it had known for a hundred years.\n\n"
    "To replace a bicycle tyre, first release the brake and open the quick-release lever so "
    "the wheel drops out of the frame. Push the valve up into the tyre, then work two tyre "
    "levers under the bead about a hand's width apart and lift one side of the tyre over the "
    "rim. Pull out the old tube, run your fingers carefully around the inside of the tyre to "
    "find whatever caused the puncture, and remove it. Put a little air into the new tube so "
    "it holds its shape, fit the valve through the rim, tuck the tube in, and roll the bead "
    "back on with your thumbs rather than the levers.\n\n"
    "Dear Ms Patel, thank you for your letter of 3 March about the delayed delivery of your "
    "order. I am sorry that the parcel arrived two weeks late and that one of the chairs was "
    "damaged. We have arranged for a courier to collect the damaged chair on Thursday morning "
    "and a replacement will be sent the same day. As an apology we have refunded the delivery "
    "charge to your card. Please let me know if there is anything else we can do.\n\n"
    "def median(values):\n"
    "    ordered = sorted(values)\n"
    "    middle = len(ordered) // 2\n"
    "    if len(ordered) % 2 == 1:\n"
    "        return ordered[middle]\n"
    "    return (ordered[middle - 1] + ordered[middle]) / 2\n"
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


def prefill_logits(engine: Any, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] of one forward pass over the whole text (the prefill path)."""
    from loom.attention import forward_context
    from loom.core.scheduler_output import ScheduledChunk

    runner = engine.runner
    blocks = list(range(-(-len(ids) // runner.block_size)))
    metadata = runner.build_metadata([ScheduledChunk("quality", ids, 0, blocks, True)])
    with torch.inference_mode(), forward_context(metadata, runner.kv_caches, runner.backend):
        hidden = runner.model(torch.tensor(ids), metadata.positions)
        return runner.model.compute_logits(hidden)


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:] under logits[:-1]."""
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
    nll = -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    return round(math.exp(nll), 4)


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
    top1 = logits[:-1].argmax(-1)
    outs = greedy(engine, prompts, max_tokens)
    row: dict[str, Any] = {"perplexity": perplexity(logits, text_ids),
                           "perplexity_prefill": perplexity(prefill_logits(engine, text_ids),
                                                            text_ids),
                           "top1": top1.tolist(), "greedy": outs}
    return row if ref is None else agreement(row, ref)


def agreement(row: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """`row` with its top-1 and greedy agreement with the float32 row `ref`."""
    top1, outs = torch.tensor(row["top1"]), row["greedy"]
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


def llama_cpp_row(args: Any, text_ids: list[int], prompts: list[list[int]], max_tokens: int,
                  ref: dict[str, Any]) -> dict[str, Any] | None:
    """evaluate()'s row for llama.cpp on the same file and token ids (None: skipped)."""
    import numpy as np

    llm = c.load_llama_cpp(args.model, n_ctx=len(text_ids) + 64, threads=args.threads,
                           disabled=args.no_llama_cpp, logits_all=True)
    if llm is None:
        return None
    llm.reset()
    llm.eval(text_ids)
    logits = torch.from_numpy(np.array(llm.scores[:len(text_ids)], dtype=np.float32))
    outs = []
    for prompt in prompts:
        tokens: list[int] = []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0,
                                  reset=True):
            tokens.append(int(token))
            if len(tokens) == max_tokens:
                break
        outs.append(tokens)
    return agreement({"perplexity": perplexity(logits, text_ids),
                      "top1": logits[:-1].argmax(-1).tolist(), "greedy": outs}, ref)


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
    if ref is not None:
        c.log("llama.cpp")
        row = llama_cpp_row(args, text_ids, prompts, max_tokens, ref)
        if row is not None:
            results["llama.cpp"] = row
    sizes = (f"text of {len(text_ids)} tokens one per step; {len(prompts_text)} prompts x "
             f"{max_tokens} greedy tokens")
    result = c.header(NAME, args, dtype="float32 reference", sizes_note=sizes,
                      max_tokens=max_tokens, results=results)
    c.finish(NAME, TITLE, result, render, args.no_doc)


def render(result: dict[str, Any]) -> str:
    """One row per mode: perplexity, agreement with float32."""
    rows = []
    for mode, r in result["results"].items():
        rows.append([mode, r["perplexity"], r.get("perplexity_prefill"), r.get("top1_agreement"),
                     r.get("greedy_identical_share"),
                     " ".join(str(n) for n in r.get("tokens_before_first_change", [])) or None])
    table = c.markdown_table(
        ["mode", "perplexity (decode path)", "perplexity (prefill path)",
         "top-1 = float32 (teacher-forced)",
         "greedy tokens identical", "tokens before first change (per prompt)"],
        rows,
    )
    return (f"{table}\n\nint8: weight-only int8 (per-channel), float32 activations; w8a8: int8 "
            "weights and activations rounded to int8 per block of 32 in the decode kernel; "
            "+kv16: the KV cache stored in float16; w4a8: the file's own blocks times int8 "
            "activations per block of 32 (the default for a quantised GGUF); llama.cpp: the "
            "same file and token ids in llama.cpp's own arithmetic (its text perplexity from "
            "one prompt).")


if __name__ == "__main__":
    main()
