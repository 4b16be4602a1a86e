"""Two builds of Loom's CPU kernels on one operation, alternating in one process.

A kernel change is judged against the source it replaces: both versions of
`loom/kernels/cpu_kernels.c` and its parts (a git revision and the working tree, or two
files) are compiled with the flags Loom uses, loaded side by side, and called in turns on
the same inputs, so a noisy host's drift hits both. The outputs are compared bit for bit
first. Prints one JSON object: best time per call of each build, streaming from memory (a
fresh copy per call, as a decode step's weights or a real model's per-layer caches are) and
hot in the caches.

    python benchmarks/ab_kernels.py --base HEAD attention --context 512 --kv-heads 32 --heads 32
    python benchmarks/ab_kernels.py --base HEAD w4a8 --rows 1 --n 16384 --k 2048 --type 12
    python benchmarks/ab_kernels.py --base HEAD w8a8 --rows 1 --n 2048 --k 8192
    python benchmarks/ab_kernels.py --base HEAD decode --model F.gguf --tokens 64
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common as c
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loom.kernels.build import (  # noqa: E402
    SIGNATURES,
    compile_variant,
    compiler_or_fail,
    runnable_variants,
    variant_named,
)
from loom.kernels.cpu_ops import w4a8_pack  # noqa: E402
from loom.kernels.w8a8_layout import to_packed_layout  # noqa: E402

SOURCE = "loom/kernels/cpu_kernels.c"


def source_of(spec: str, folder: Path, name: str) -> Path:
    """`spec`: a file path, "WORKTREE", or a git revision whose kernel source is used."""
    if spec == "WORKTREE":
        return ROOT / SOURCE
    if Path(spec).is_file():
        return Path(spec)
    # The revision's whole kernels folder: the unit includes its parts by relative path.
    tree = folder / name
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", spec, "loom/kernels"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree / SOURCE


def build(source: Path, variant: str, out: Path) -> ctypes.CDLL:
    """Compile `source` as Loom compiles that variant and load it, typed."""
    compile_variant(compiler_or_fail(), variant_named(variant), source, out)
    lib = ctypes.CDLL(str(out))
    for name, argtypes in SIGNATURES.items():
        function = getattr(lib, name, None)
        if function is not None:
            function.argtypes = argtypes
    return lib


def attention_case(args: argparse.Namespace) -> tuple[Callable[[Any, int], torch.Tensor], int,
                                                          float]:
    """One decode row over `--context` tokens in each of `--layers` caches (float16)."""
    ctx, hkv, h, d, bs = args.context, args.kv_heads, args.heads, args.head_dim, 16
    blocks = max(64, 2 * ctx // bs)
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn((2, blocks, bs, hkv, d), generator=g).to(torch.float16)
              for _ in range(args.layers)]
    nb = -(-ctx // bs)
    table = torch.randperm(blocks, generator=g)[:nb].view(1, -1).to(torch.int64).contiguous()
    q = torch.randn(1, h, d, generator=g)
    starts, lens = torch.tensor([0, 1]), torch.tensor([ctx])
    out = torch.empty(1, h, d)

    def call(lib: Any, i: int) -> torch.Tensor:
        cache = caches[i]
        lib.loom_paged_attention(q.data_ptr(), starts.data_ptr(), cache[0].data_ptr(),
                                 cache[1].data_ptr(), table.data_ptr(), nb, lens.data_ptr(), 1,
                                 h, hkv, d, bs, 0, d ** -0.5, 0.0, ctx, out.data_ptr(), 1)
        return out

    return call, len(caches), 2 * ctx * hkv * d * 2


def w4a8_case(args: argparse.Namespace) -> tuple[Callable[[Any, int], torch.Tensor], int,
                                                     float]:
    """`--rows` rows times a random [n, k] matrix of GGUF type `--type` (Q4_K 12, Q6_K 14,
    Q4_0 2, Q8_0 8, MXFP4 39), packed for w4a8 by each build itself (a layout change packs
    differently; a record is at most 320 bytes a block of 32 k). The bytes per call are this
    checkout's layout's."""
    n, k, type_id, m = args.n, args.k, args.type, args.rows
    g = torch.Generator().manual_seed(0)
    # block bytes, values a block, where its float16 scales lie (MXFP4: an E8M0 byte)
    block_bytes, values, scales = {12: (144, 256, (0, 2)), 14: (210, 256, (208,)),
                                   2: (18, 32, (0,)), 8: (34, 32, (0,)),
                                   39: (17, 32, ())}[type_id]
    copies = max(1, 200_000_000 // (n * k))
    raws = []
    for _ in range(copies):
        raw = torch.randint(0, 256, (n * k // values, block_bytes), dtype=torch.uint8,
                            generator=g)
        for at in scales:  # small normal float16 values (no NaN or subnormal)
            raw[:, at:at + 2] = torch.tensor([0, 0x1C], dtype=torch.uint8)
        if type_id == 39:
            raw[:, 0] = 120  # E8M0 2^-8
        raws.append(raw.reshape(-1))
    x = torch.randn(m, k, generator=g)
    y = torch.empty(m, n)
    types, columns = (ctypes.c_int64 * 1)(type_id), (ctypes.c_int64 * 1)(n)
    packed: dict[int, list[tuple[torch.Tensor, Any]]] = {}  # id(lib) -> (weight, pointer)

    def weights_of(lib: Any) -> list[tuple[torch.Tensor, Any]]:
        if id(lib) not in packed:
            packed[id(lib)] = []
            for raw in raws:
                out = torch.empty(-(-n // 8) * (k // 32) * 320, dtype=torch.uint8)
                if lib.loom_w4a8_pack(type_id, raw.data_ptr(), n, k, out.data_ptr()) != 0:
                    raise ValueError(f"the build cannot pack type {type_id}")
                packed[id(lib)].append((out, (ctypes.c_void_p * 1)(out.data_ptr())))
        return packed[id(lib)]

    def call(lib: Any, i: int) -> torch.Tensor:
        _, pointer = weights_of(lib)[i]
        lib.loom_linear_w4a8(x.data_ptr(), m, k, 1, types, pointer, columns, None,
                             y.data_ptr())
        return y

    return call, copies, w4a8_pack(raws[0], type_id, n, k).numel()


def w8a8_case(args: argparse.Namespace) -> tuple[Callable[[Any, int], torch.Tensor], int,
                                                     float]:
    """`--rows` rows times a random [n, k] int8 matrix packed for the w8a8 kernel."""
    n, k, m = args.n, args.k, args.rows
    g = torch.Generator().manual_seed(0)
    copies = max(1, 400_000_000 // (n * k))
    weights = [to_packed_layout(torch.randint(-127, 128, (n, k), dtype=torch.int8,
                                              generator=g)) for _ in range(copies)]
    scale = torch.rand(n, generator=g) / 100
    x = torch.randn(m, k, generator=g)
    y = torch.empty(m, n)

    def call(lib: Any, i: int) -> torch.Tensor:
        lib.loom_linear_w8a8_packed(x.data_ptr(), m, k, weights[i].data_ptr(), scale.data_ptr(),
                                    None, n, y.data_ptr())
        return y

    return call, copies, weights[0].numel()


def decode_rounds(args: argparse.Namespace, libs: list[ctypes.CDLL]) -> dict[str, Any]:
    """A whole model's greedy generation, its decoder layers (`loom_decode_layers`, the
    fused decode step) run by each build in turn; the rest of the step runs the engine's
    own build. Returns the per-build best tok/s and whether both generated the same tokens."""
    from loom import LLM, SamplingParams

    llm = LLM(model=args.model, quantization=args.quantization, kv_cache_dtype="float16")
    prompt = {"prompt_token_ids": list(range(100, 100 + args.prompt))}
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params)  # builds the fused decoder
    decoder = llm.engine.runner.model.fused_decoder
    assert decoder is not None, "this model does not run the fused decoder"
    steps = []
    for lib in libs:
        fn = lib.loom_decode_layers
        fn.argtypes, fn.restype = decoder._fn.argtypes, None
        steps.append(fn)
    best, tokens = [float("inf")] * 2, [None, None]
    for _ in range(args.rounds):
        for i, fn in enumerate(steps):
            decoder._fn = fn
            start = time.perf_counter()
            out = llm.generate([prompt], params)  # the prompt is a prefix-cache hit
            best[i] = min(best[i], time.perf_counter() - start)
            tokens[i] = out[0].outputs[0].token_ids
    return {"same_tokens": tokens[0] == tokens[1],
            **{name: {"tok_s": round(args.tokens / best[i], 2)}
               for i, name in enumerate(("base", "new"))},
            "new / base speed": round(best[0] / best[1], 3)}


def main() -> None:
    """Parse the arguments, build both sources, alternate them, print the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="git revision or file (A)")
    parser.add_argument("--new", default="WORKTREE", help="git revision, file or WORKTREE (B)")
    parser.add_argument("--variant", default=None, help="kernel variant (default: widest here)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None)
    sub = parser.add_subparsers(dest="op", required=True)
    attention = sub.add_parser("attention", help="a decode row's paged attention")
    attention.add_argument("--context", type=int, default=512)
    attention.add_argument("--kv-heads", type=int, default=32)
    attention.add_argument("--heads", type=int, default=32)
    attention.add_argument("--head-dim", type=int, default=64)
    attention.add_argument("--layers", type=int, default=24)
    w4a8 = sub.add_parser("w4a8", help="a w4a8 linear layer")
    w4a8.add_argument("--rows", type=int, default=1)
    w4a8.add_argument("--n", type=int, default=16384)
    w4a8.add_argument("--k", type=int, default=2048)
    w4a8.add_argument("--type", type=int, default=12, choices=[12, 14, 2, 8, 39])
    w8a8 = sub.add_parser("w8a8", help="a w8a8 linear layer")
    w8a8.add_argument("--rows", type=int, default=1)
    w8a8.add_argument("--n", type=int, default=16384)
    w8a8.add_argument("--k", type=int, default=2048)
    decode = sub.add_parser("decode", help="a model's decode steps (its decoder layers)")
    decode.add_argument("--model", required=True)
    decode.add_argument("--quantization", default="w4a8")
    decode.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    decode.add_argument("--tokens", type=int, default=64, help="generated tokens")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variant = args.variant or runnable_variants()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        libs = [build(source_of(spec, folder, name), variant, folder / f"{name}.so")
                for name, spec in (("base", args.base), ("new", args.new))]
        if args.op == "decode":
            print(json.dumps({"command": c.command_line(), "machine": c.machine_info(),
                              "variant": variant, **decode_rounds(args, libs)}, indent=1))
            return
        cases = {"attention": attention_case, "w4a8": w4a8_case, "w8a8": w8a8_case}
        call, copies, nbytes = cases[args.op](args)
        outputs = [call(lib, 0).clone() for lib in libs]
        stream, hot = [float("inf")] * 2, [float("inf")] * 2
        for _ in range(args.rounds):
            for i, lib in enumerate(libs):
                start = time.perf_counter()
                for j in range(copies):
                    call(lib, j)
                stream[i] = min(stream[i], (time.perf_counter() - start) / copies)
                start = time.perf_counter()
                for _ in range(10):
                    call(lib, 0)
                hot[i] = min(hot[i], (time.perf_counter() - start) / 10)
    result = {
        "command": c.command_line(), "machine": c.machine_info(), "variant": variant,
        "op": vars(args), "same_bits": bool(torch.equal(outputs[0], outputs[1])),
        "bytes_per_call": nbytes,
        **{name: {"stream_ms": round(stream[i] * 1e3, 3), "hot_ms": round(hot[i] * 1e3, 3),
                  "stream_gb_s": round(nbytes / stream[i] / 1e9, 2)}
           for i, name in enumerate(("base", "new"))},
        "stream new / base speed": round(stream[0] / stream[1], 3),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
