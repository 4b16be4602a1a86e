"""Batch invariance, measured: the same prompts alone and in every way a step can hold them.

The invariance property test (tests/engine/test_batch_invariance.py) proves the default
mode on tiny models on a CPU; this is its form for a real model's shape on any device (the
GPU above all, where cuBLAS chooses its algorithm by the batch's shape). Every prompt is
first generated alone (one prefill step, then decodes of one sequence: the reference). The
same prompts then run:

- `batch`: all at once (decode batches of up to `--num-prompts`, prefill chunks packed);
- `arrivals`: one new prompt per step, so every batch size from 1 up is met;
- `chunked`: steps of `--chunk` tokens (prompts cut into chunks, beside decodes), with the
  prefix cache on (half the prompts share a prefix, found in the cache);
- `cache hit`: the same engine again (every prompt's blocks are cached);
- `session`: each prompt fed to a live session in three fragments, then generated.

For each: sequences whose tokens differ from the reference, the generated tokens from the
first difference on, and the largest |difference| of a logprob both report at a position
before any difference (the sampled token's and the top `--top`). The default mode keeps the
guarantee where all three are 0. `--modes default default+cublas` compares the default with
cuBLAS's GEMMs (EngineArgs.batch_invariant=False) in the same run.
"""

from __future__ import annotations

import random
import time
from typing import Any

import common as c

NAME = "invariance"
TITLE = "Batch invariance: the same prompts alone and batched, chunked, cached, appended"


def prompts_for(args: Any, vocab: int) -> list[list[int]]:
    """`--num-prompts` random prompts of 16-`--max-len` tokens; the even ones share a prefix
    of a quarter of the longest length."""
    rng = random.Random(0)
    shared = [rng.randrange(10, vocab) for _ in range(args.max_len // 4)]
    out = []
    for i in range(args.num_prompts):
        n = rng.randint(16, args.max_len)
        tail = [rng.randrange(10, vocab) for _ in range(n)]
        out.append((shared + tail)[:n] if i % 2 == 0 else tail)
    return out


def collect(engine: Any, add_one: Any, indices: list[int],
            per_step: int | None = None) -> dict[int, tuple]:
    """Add the requests of `indices` through `add_one(i)` (all at once, or `per_step` before
    each step) and run them; (token ids, logprobs) by index."""
    waiting, last = list(indices), {}
    while waiting or engine.has_unfinished_requests():
        for _ in range(len(waiting) if per_step is None else per_step):
            if waiting:
                add_one(waiting.pop(0))
        for out in engine.step():
            last[out.request_id] = out
    c.device_sync()
    result = {}
    for rid, out in last.items():
        if rid.startswith("p"):
            seq = out.outputs[0]
            result[int(rid[1:].split("-")[0])] = (list(seq.token_ids), list(seq.logprobs))
    return result


def compare(got: dict[int, tuple], ref: dict[int, tuple]) -> dict[str, Any]:
    """Sequences differing, tokens from each first difference on, largest logprob gap."""
    differing = tokens_off = 0
    worst = 0.0
    for i, (want_ids, want_lp) in ref.items():
        ids, lps = got[i]
        same = 0
        while same < min(len(ids), len(want_ids)) and ids[same] == want_ids[same]:
            same += 1
        if same < len(want_ids) or len(ids) != len(want_ids):
            differing += 1
            tokens_off += len(want_ids) - same
        for a, b in zip(lps[:same + 1], want_lp[:same + 1], strict=False):
            for token in a.keys() & b.keys():
                worst = max(worst, abs(a[token] - b[token]))
    return {"sequences_differing": differing, "tokens_differing": tokens_off,
            "max_logprob_diff": worst}


def run_mode(args: Any, mode: str) -> dict[str, Any]:
    """Every scenario of one Loom mode against its own alone-reference."""
    from loom import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, logprobs=args.top,
                            ignore_eos=True)
    kwargs = c.loom_mode_kwargs(mode)
    began = time.perf_counter()
    plain = c.make_engine(args, **kwargs, max_num_batched_tokens=4096,
                          enable_prefix_caching=False)
    chunked = c.make_engine(args, **kwargs, max_num_batched_tokens=args.chunk,
                            enable_prefix_caching=True)
    c.log(f"{mode}: engines ready in {time.perf_counter() - began:.1f} s "
          f"({plain.config.mode_summary})")
    prompts = prompts_for(args, min(plain.config.vocab_size, 32_000))

    def add_to(engine: Any, tag: str):
        return lambda i: engine.add_request(f"p{i}-{tag}", prompts[i], params)

    every = list(range(len(prompts)))
    reference: dict[int, tuple] = {}
    for i in every:  # alone: one request in the engine at a time
        reference.update(collect(plain, add_to(plain, "ref"), [i]))
    runs = {
        "batch": collect(plain, add_to(plain, "batch"), every),
        "arrivals": collect(plain, add_to(plain, "arrive"), every, per_step=1),
        "chunked": collect(chunked, add_to(chunked, "chunk"), every),
        "cache hit": collect(chunked, add_to(chunked, "hit"), every),
        "session": run_sessions(plain, prompts, params),
    }
    result = {"mode": mode, "summary": plain.config.mode_summary,
              "scenarios": {name: compare(got, reference) for name, got in runs.items()}}
    result["seconds"] = round(time.perf_counter() - began, 1)
    assert plain.kv_pool_all_free and chunked.kv_pool_all_free
    return result


def run_sessions(engine: Any, prompts: list[list[int]], params: Any) -> dict[int, tuple]:
    """Each prompt fed to a session in three fragments (all sessions live at once), then
    generated; (token ids, logprobs) by index."""
    pieces = []
    for i, prompt in enumerate(prompts):
        cut1, cut2 = len(prompt) // 3 or 1, 2 * len(prompt) // 3 or 1
        pieces.append([prompt[:cut1], prompt[cut1:cut2], prompt[cut2:]])
        engine.add_request(f"p{i}-s", pieces[i][0], session=True)
    c.settle(engine)
    for step in (1, 2):
        for i in range(len(prompts)):
            if pieces[i][step]:
                engine.append(f"p{i}-s", pieces[i][step])
        c.settle(engine)
    last = {}
    for i in range(len(prompts)):
        engine.resume(f"p{i}-s", params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
    c.device_sync()
    result = {}
    for i in range(len(prompts)):
        seq = last[f"p{i}-s"].outputs[0]  # a session's tokens include the fragments
        result[i] = (list(seq.token_ids)[-len(seq.logprobs):], list(seq.logprobs))
        engine.close(f"p{i}-s")
    return result


def render(result: dict[str, Any]) -> str:
    rows = []
    for run in result["modes"]:
        for name, s in run["scenarios"].items():
            rows.append([run["mode"], name, s["sequences_differing"], s["tokens_differing"],
                         f"{s['max_logprob_diff']:.3g}"])
    return c.markdown_table(
        ["mode", "scenario", "sequences differing", "tokens differing",
         "largest logprob difference"], rows)


def main() -> None:
    parser = c.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["default"])
    parser.add_argument("--num-prompts", type=int, default=None, help="default 64 (quick 8)")
    parser.add_argument("--max-len", type=int, default=None, help="default 400 (quick 60)")
    parser.add_argument("--tokens", type=int, default=None, help="default 24 (quick 6)")
    parser.add_argument("--top", type=int, default=5, help="top logprobs compared")
    parser.add_argument("--chunk", type=int, default=64, help="step budget of `chunked`")
    args = parser.parse_args()
    if args.doc_only:
        c.rerender(NAME, TITLE, render)
        return
    args.num_prompts = args.num_prompts or (8 if args.quick else 64)
    args.max_len = args.max_len or (60 if args.quick else 400)
    args.tokens = args.tokens or (6 if args.quick else 24)
    result = c.header(NAME, args, sizes_note=(
        f"{args.num_prompts} prompts of 16-{args.max_len} tokens, {args.tokens} greedy "
        f"tokens, top {args.top} logprobs, chunks of {args.chunk}"))
    modes = []
    for mode in args.modes:
        modes.append(run_mode(args, mode))
        c.log(f"{mode}: {modes[-1]['scenarios']}")
    result["modes"] = modes
    c.finish(NAME, TITLE, result, render, args.no_doc)


if __name__ == "__main__":
    main()
