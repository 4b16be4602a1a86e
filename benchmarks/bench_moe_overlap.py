"""How many distinct experts the decode steps of N concurrent streams choose, and the bound
that puts on N streams' speed over one.

A step's rows are grouped by expert (`loom/kernels/cpu/moe.c`), so an N-row decode step
reads the shared weights (attention, router, output head) once and each expert that any row
chose once. With `used` of `experts` chosen per token, independent uniform routing gives
`experts * (1 - (1 - used / experts) ** N)` distinct experts a layer. This measures the real
count on a mixture-of-experts GGUF in Loom's default mode, with `bench_model_sizes.py`'s
stream workload (N random prompts, each stream sampled at temperature 1 with its own seed,
EOS ignored): every N-row step's distinct experts per layer, counted from the router's
choices (the same float32 router and routing as the fused C step; the layers run through
their modules here so the choices can be read). From the prepared weights' bytes it reports
one token's bytes, an N-row step's bytes, and `N * one / step`: the speed of N streams over
one that a step reading at the same bandwidth as a one-token step reaches.

    python benchmarks/bench_moe_overlap.py --gguf FILE.gguf --streams 8 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from bench_model_sizes import prepared_read_bytes


def count_distinct(path: Path, streams: int, prompt_len: int, tokens: int,
                   seed: int) -> dict[str, Any]:
    """Distinct experts per layer of every `streams`-row step, and the block's shape."""
    from loom import LLM, SamplingParams
    from loom.cache_dir import loom_cache_dir
    from loom.models.moe import SparseMoE

    llm = LLM(model=str(path))
    engine = llm.engine
    engine.runner.model.use_fused_decode = False  # the blocks' forward, so routing is seen
    counts: list[int] = []
    shape: dict[str, int] = {}
    forward = SparseMoE.forward

    def counting_forward(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == streams:
            _, chosen = block.route(x)
            counts.append(int(torch.unique(chosen).numel()))
            shape.update(experts=block.num_experts, used=block.top_k)
        return forward(block, x)

    SparseMoE.forward = counting_forward  # type: ignore[method-assign]
    try:
        vocab = engine.inputs.vocab_size
        g = torch.Generator().manual_seed(seed)
        for i in range(streams):
            prompt = torch.randint(100, vocab - 100, (prompt_len,), generator=g).tolist()
            params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True,
                                    seed=1000 + i)
            engine.add_request(f"overlap-{i}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        SparseMoE.forward = forward  # type: ignore[method-assign]
    if not counts:
        raise SystemExit(f"{path.name}: no {streams}-row step went through an MoE block")
    prepared = sorted(loom_cache_dir("prepared").glob(f"{path.stem}-*.safetensors"),
                      key=lambda p: p.stat().st_mtime)
    return {"counts": counts, "prepared": prepared[-1:], **shape}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    got = count_distinct(args.gguf.expanduser(), args.streams, args.prompt_len, args.tokens,
                         args.seed)
    experts, used, counts = got["experts"], got["used"], got["counts"]
    mean = statistics.mean(counts)
    uniform = experts * (1 - (1 - used / experts) ** args.streams)
    out: dict[str, Any] = {
        "file": args.gguf.name, "streams": args.streams, "experts": experts, "used": used,
        "layer_steps": len(counts), "distinct_mean": round(mean, 2),
        "distinct_min": min(counts), "distinct_max": max(counts),
        "distinct_uniform_independent": round(uniform, 2),
    }
    if got["prepared"]:
        one = prepared_read_bytes(got["prepared"], used / experts)
        step = prepared_read_bytes(got["prepared"], mean / experts)
        out.update(one_token_bytes=one, step_bytes=step,
                   step_over_one_token=round(step / one, 3),
                   streams_over_one_at_equal_bandwidth=round(args.streams * one / step, 3))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
