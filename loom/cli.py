"""The `loom` command: `loom generate --model gemma3-270m --max-tokens 32 "Once upon a time"`,
`loom serve --model gemma3-270m --port 8000`, `loom demo`."""

from __future__ import annotations

import argparse
import sys
import time

from loom.errors import LoomError


def _parser() -> argparse.ArgumentParser:
    from loom.models.quant_method import QUANTIZATIONS  # torch: only once a command runs

    parser = argparse.ArgumentParser(prog="loom", description="Loom LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate continuations of prompts (offline)")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--model", default="gemma3-270m", help="alias, HF folder or .gguf file")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--device", default="auto")
    gen.add_argument("--quantization", default="auto", choices=["auto", "none", *QUANTIZATIONS],
                     help="auto: w4a8 (the file's blocks) for a quantized GGUF on the CPU "
                          "kernels, else none (exact dequantised float weights)")
    gen.add_argument("--kv-cache-dtype", default="auto",
                     help="auto (float16 with auto-chosen w4a8, else the model dtype), "
                          "float16, bfloat16 or float32")
    gen.add_argument("--num-speculative-tokens", type=int, default=0,
                     help="draft this many tokens per step by n-gram prompt lookup (0: off)")
    gen.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="split the model over this many processes (torch.distributed)")
    sub.add_parser("demo", help="run the live-session demo (madlibs)")
    from loom.server.cli import add_serve_parser

    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `loom` console script."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            from loom.server.cli import serve

            return serve(args)
        if args.command == "demo":
            from loom.demo import main as demo_main

            demo_main()
            return 0
        return _generate(args)
    except LoomError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace) -> int:
    from loom import LLM, SamplingParams

    llm = LLM(
        model=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
        speculative_config=(
            {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
            if args.num_speculative_tokens > 0 else None
        ),
    )
    print(f"loaded {args.model} ({llm.engine.config.mode_summary})", file=sys.stderr)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    start = time.perf_counter()
    outputs = llm.generate(args.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = 0
    for out in outputs:
        completion = out.outputs[0]
        num_tokens += len(completion.token_ids)
        print(f"--- {out.prompt!r}")
        print(completion.text)
    print(f"[{num_tokens} tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tokens/s]")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
