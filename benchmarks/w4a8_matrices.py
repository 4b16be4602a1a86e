"""w4a8 against w8a8 on single matrices, every block type, one kernel build, alternating.

What a mode costs per matrix, apart from the rest of a model: `loom_linear_w4a8` on random
file blocks of each GGUF type against `loom_linear_w8a8_packed` on an int8 matrix of the
same shape (both through their Python wrappers), called in turns on the same activations
(`--rows` of them: 512 is a prefill chunk, 1 a decode row), best of `--rounds`. Prints one
JSON object (ms per call, and each type's time over w8a8's) and writes it to
`benchmarks/results/w4a8-default/matrices.json`.

    python benchmarks/w4a8_matrices.py --rows 512
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import common as c
import numpy as np
import torch
from gguf import GGMLQuantizationType

from loom.kernels import GGUF_C_BLOCK_TYPES, linear_w4a8, linear_w8, w4a8_pack
from loom.kernels.w8a8_layout import to_packed_layout

# (n, k, types): Gemma 3 270M's q/k/v, gate/up and down; a 3B's q/o and gate/up; an 8B's
# q/o, gate/up and down.
SHAPES = [(1536, 640, (6, 8)), (4096, 640, (6, 2, 3, 7)), (640, 2048, (12, 14)),
          (3072, 3072, (12, 13, 14)), (8192, 3072, (12, 14)), (4096, 4096, (12, 14)),
          (14336, 4096, (12,)), (4096, 14336, (12, 14))]
# Where each type's float16 scales lie in a block (d, and dmin or m).
SCALES_AT = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2),
             14: (208,)}


def random_blocks(type_id: int, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random file blocks of a [n, k] tensor, small float16 scales (no NaN or subnormal)."""
    block_bytes, block_values = GGUF_C_BLOCK_TYPES[type_id]
    count = n * k // block_values
    blocks = rng.integers(0, 256, size=(count, block_bytes), dtype=np.uint8)
    for at in SCALES_AT[type_id]:
        scales = (rng.random(count, dtype=np.float32) * 2e-3 + 1e-4).astype(np.float16)
        blocks[:, at:at + 2] = scales.view(np.uint8).reshape(count, 2)
    return torch.from_numpy(blocks.reshape(n, -1))


def best_of(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Best seconds per call of each, called in turns."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    """Parse the arguments, time every shape and type, print and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for n, k, types in SHAPES:
        x = torch.randn(args.rows, k, generator=torch.Generator().manual_seed(n + k))
        w8 = to_packed_layout(torch.from_numpy(rng.integers(-127, 128, (n, k), dtype=np.int8)))
        scale = torch.full((n,), 1e-2)
        calls: dict[str, Callable[[], object]] = {
            "w8a8": lambda x=x, w8=w8, scale=scale: linear_w8(
                x, w8, scale, None, quantize_activations=True, layout="packed")}
        for t in types:
            segments = [(t, w4a8_pack(random_blocks(t, n, k, rng), t, n, k), n)]
            calls[GGMLQuantizationType(t).name] = lambda x=x, s=segments: linear_w4a8(x, s, None)
        best = best_of(calls, args.rounds)
        rows.append({"n": n, "k": k, "ms": {m: round(v * 1e3, 3) for m, v in best.items()},
                     "over_w8a8": {m: round(v / best["w8a8"], 3) for m, v in best.items()
                                   if m != "w8a8"}})
        c.log(f"{n} x {k}: " + ", ".join(f"{m} {v}" for m, v in rows[-1]["over_w8a8"].items()))
    result = {"command": c.command_line(), "machine": c.machine_info(), "rows": args.rows,
              "rounds": args.rounds, "matrices": rows}
    out = c.RESULTS_DIR / "w4a8-default" / "matrices.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
