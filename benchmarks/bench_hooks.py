"""Fan-out with the `<promise>`/`<sync>` hook against the same sub-tasks as separate requests.

A parent with a long prompt (`--parent-tokens`, ~1000) emits `<promise>` `--children` times,
then `<sync>`: each promise forks a child that shares the parent's KV blocks and generates
`--child-tokens` tokens, the join appends the children's merged text to the parent, which
then generates `--tail-tokens` more. The tokens are forced by a logits processor; the two
special tokens are unused Gemma tokens (`<unused0>`, `<unused1>`).

The baseline runs the same work without the hook: one request per child whose prompt is the
full context the child sees (parent prompt + its promises), all submitted together, then a
final request with the parent's context, `<sync>` and the merged text. Reported: wall time
and the peak number of KV blocks in use (sampled after every engine step).
"""

from __future__ import annotations

from typing import Any

import common as c

NAME = "hooks"
TITLE = "Promise/sync fan-out against separate requests"
NEG = -1e9


class Plan:
    """A logits processor forcing the fan-out: (prompt, output, logits) -> logits.

    A child's prompt ends with `<promise>`: it writes `child_tokens` model tokens, then
    `<sync>`. The parent writes `<promise>` x children, `<sync>`, then model tokens. With
    `final=True` (the baseline's last request) it only keeps the model off both tokens.
    """

    def __init__(self, promise: int, sync: int, children: int, child_tokens: int,
                 final: bool = False) -> None:
        self.promise, self.sync = promise, sync
        self.children, self.child_tokens, self.final = children, child_tokens, final

    def __call__(self, prompt: list[int], output: list[int], logits: Any) -> Any:
        """Force or forbid the special tokens for this row."""
        forced = None
        if not self.final and prompt and prompt[-1] == self.promise:
            forced = self.sync if len(output) >= self.child_tokens else None
        elif not self.final and len(output) <= self.children:
            forced = self.promise if len(output) < self.children else self.sync
        if forced is None:
            logits[self.promise] = NEG
            logits[self.sync] = NEG
            return logits
        logits.fill_(NEG)
        logits[forced] = 0.0
        return logits


class PeakBlocks:
    """Samples the KV blocks in use after each engine step and keeps the maximum."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.total = engine.scheduler.kv.pool.num_blocks
        self.peak = 0

    def __call__(self) -> None:
        """Take one sample."""
        self.peak = max(self.peak, self.total - self.engine.num_free_blocks)


def run_hook(engine: Any, parent: list[int], args: Any, promise: int, sync: int) -> dict:
    """The parent request with the hook; returns time, peak blocks and children's texts."""
    from loom import SamplingParams

    plan = Plan(promise, sync, args.children, args.child_tokens)
    params = SamplingParams(temperature=0.0, ignore_eos=True, logits_processors=[plan],
                            max_tokens=args.children + 1 + args.tail_tokens)
    peak = PeakBlocks(engine)
    outputs: dict[str, Any] = {}
    start = c.now()
    engine.add_request("tree", parent, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        peak()
    elapsed = c.now() - start
    out = outputs["tree"]
    texts = [engine.tokenizer.decode(ch.outputs[0].token_ids[: args.child_tokens])
             for ch in out.children]
    assert len(texts) == args.children, f"expected {args.children} children, got {len(texts)}"
    return {"time_s": round(elapsed, 3), "peak_blocks": peak.peak, "children_text": texts}


def run_separate(engine: Any, parent: list[int], args: Any, promise: int,
                 sync: int) -> tuple[dict, list[str]]:
    """The same sub-tasks as separate requests, each with its full context, then the join."""
    from loom import SamplingParams
    from loom.engine.promise_sync import join_with_newlines

    plan = Plan(promise, sync, args.children, args.child_tokens)
    child = SamplingParams(temperature=0.0, ignore_eos=True, logits_processors=[plan],
                           max_tokens=args.child_tokens)
    peak = PeakBlocks(engine)
    outputs: dict[str, Any] = {}
    start = c.now()
    for i in range(args.children):
        engine.add_request(f"sub-{i}", parent + [promise] * (i + 1), child)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        peak()
    texts = [outputs[f"sub-{i}"].outputs[0].text for i in range(args.children)]
    merged = engine.tokenizer.encode(join_with_newlines(texts), add_special_tokens=False)
    final = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.tail_tokens,
                           logits_processors=[Plan(promise, sync, 0, 0, final=True)])
    engine.add_request("final", parent + [promise] * args.children + [sync] + merged, final)
    c.settle(engine, peak)
    elapsed = c.now() - start
    return {"time_s": round(elapsed, 3), "peak_blocks": peak.peak}, texts


def main() -> None:
    """Parse arguments, run both ways on one engine, report."""
    parser = c.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--parent-tokens", type=int, default=None, help="1000 (quick 512)")
    parser.add_argument("--children", type=int, default=None, help="default 8 (quick 4)")
    parser.add_argument("--child-tokens", type=int, default=None, help="default 32 (quick 8)")
    parser.add_argument("--tail-tokens", type=int, default=8)
    args = parser.parse_args()
    if args.doc_only:
        return c.rerender(NAME, TITLE, render)
    args.parent_tokens = args.parent_tokens or (512 if args.quick else 1000)
    args.children = args.children or (4 if args.quick else 8)
    args.child_tokens = args.child_tokens or (8 if args.quick else 32)
    args.repeats = args.repeats or 1

    from loom.engine.promise_sync import SpecialKwargs
    from loom.tokenizer import load_tokenizer

    tok = load_tokenizer(c.model_path(args.model))
    promise, sync = tok.token_to_id("<unused0>"), tok.token_to_id("<unused1>")
    special = SpecialKwargs(promise_token_id=promise, sync_token_id=sync,
                            child_max_tokens=args.child_tokens + 1, max_children=args.children)
    engine = c.make_engine(args, special_kwargs=special, kv_cache_memory_gb=2.0)
    dtype = engine.config.dtype
    parent = c.prompt_token_ids(tok, args.parent_tokens, seed=1)
    block = engine.config.block_size

    # Warm up on a short parent, then alternate the two ways `repeats` times.
    warm = Plan(promise, sync, 1, 2)
    from loom import SamplingParams

    engine.add_request("warm", parent[:64], SamplingParams(
        temperature=0.0, ignore_eos=True, max_tokens=4, logits_processors=[warm]))
    c.settle(engine)
    hook_runs, sep_runs, sep_texts = [], [], []
    for r in range(args.repeats):
        c.log(f"hook: {args.children} children of a {args.parent_tokens}-token parent ({r})")
        hook_runs.append(run_hook(engine, parent, args, promise, sync))
        assert engine.kv_pool_all_free
        c.log(f"separate requests ({r})")
        sep, sep_texts = run_separate(engine, parent, args, promise, sync)
        sep_runs.append(sep)
        assert engine.kv_pool_all_free
    hook = {"time_s": c.median([h["time_s"] for h in hook_runs]),
            "peak_blocks": max(h["peak_blocks"] for h in hook_runs)}
    separate = {"time_s": c.median([s["time_s"] for s in sep_runs]),
                "peak_blocks": max(s["peak_blocks"] for s in sep_runs)}
    same = [a.strip() == b.strip() for a, b in
            zip(hook_runs[0]["children_text"], sep_texts, strict=True)]
    ratios = {"time_separate_over_hook": c.ratio(separate["time_s"], hook["time_s"]),
              "blocks_separate_over_hook": c.ratio(separate["peak_blocks"], hook["peak_blocks"])}
    sizes = (f"parent {args.parent_tokens} tokens, {args.children} children x "
             f"{args.child_tokens} tokens, tail {args.tail_tokens}, block size {block}, "
             f"median of {args.repeats}")
    result = c.header(NAME, args, dtype=dtype, sizes_note=sizes,
                      promise_token_id=promise, sync_token_id=sync,
                      parent_tokens=args.parent_tokens, children=args.children,
                      child_tokens=args.child_tokens, tail_tokens=args.tail_tokens,
                      results={"hook": hook, "separate": separate}, ratios=ratios,
                      children_match_separate=same, runs={"hook": hook_runs,
                                                          "separate": sep_runs})
    c.finish(NAME, TITLE, result, render, args.no_doc)


def render(result: dict[str, Any]) -> str:
    """The doc section's body: the two ways and their ratio."""
    hook, separate = result["results"]["hook"], result["results"]["separate"]
    ratios, same = result["ratios"], result["children_match_separate"]
    rows = [["promise/sync hook (shared KV)", hook["time_s"], hook["peak_blocks"]],
            ["separate requests (full context each)", separate["time_s"],
             separate["peak_blocks"]],
            ["separate / hook", ratios["time_separate_over_hook"],
             ratios["blocks_separate_over_hook"]]]
    table = c.markdown_table(["way", "wall s", "peak KV blocks"], rows)
    return (f"{table}\n\nChildren's texts equal to the separate requests' (greedy): "
            f"{sum(same)}/{len(same)}. Loom only: the peers have no fork/join of KV."
            "\n\n![hooks](bench_hooks.png)")


if __name__ == "__main__":
    main()
