"""What Ray Serve costs a call: start-up (Ray, 2 replicas) and the round trip of an engine
call over the deployment handle against the same call in process.

    python benchmarks/bench_replicas.py [--model PATH] [--calls 200]

Without `--model` it builds the tests' tiny random Gemma 3 (the engine's own work is then
negligible, so the difference is the transport). Prints one JSON object; writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def tiny_model(folder: Path) -> str:
    from tiny_reference import build_tiny_model

    build_tiny_model("gemma3", folder / "gemma3")
    return str(folder / "gemma3")


async def per_call_ms(client, calls: int) -> dict[str, float]:
    """Median ms of `holds` and of a one-token `append` to a paused session."""
    await client.add_request("bench", [2, 5, 6, 7, 8, 9, 10, 11], None, session=True)
    timings: dict[str, list[float]] = {"holds": [], "append": []}
    for i in range(calls):
        began = time.perf_counter()
        await client.holds("bench")
        timings["holds"].append(time.perf_counter() - began)
        began = time.perf_counter()
        await client.append("bench", [12 + i % 50])
        timings["append"].append(time.perf_counter() - began)
    await client.close("bench")
    return {f"{k}_ms": round(statistics.median(v) * 1e3, 3) for k, v in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--replicas", type=int, default=2)
    opts = parser.parse_args()
    import ray

    from loom.distributed.launch import start_replicas
    from loom.engine.async_engine import AsyncLLMEngine
    from loom.engine.config import EngineArgs

    with tempfile.TemporaryDirectory() as tmp:
        model = opts.model or tiny_model(Path(tmp))
        args = EngineArgs(model=model, dtype="float32", device="cpu", num_kv_blocks=256,
                          block_size=4, session_ttl_s=None)
        local = AsyncLLMEngine.from_engine_args(args)
        in_process = asyncio.run(per_call_ms(local, opts.calls))
        local.shutdown()
        began = time.perf_counter()
        ray.init(include_dashboard=False, log_to_driver=False)
        ray_init_s = time.perf_counter() - began
        began = time.perf_counter()
        client = start_replicas(args, opts.replicas)
        start_s = time.perf_counter() - began
        try:
            over_ray = asyncio.run(per_call_ms(client, opts.calls))
        finally:
            client.shutdown()
            ray.shutdown()
    print(json.dumps({"ray_init_s": round(ray_init_s, 2),
                      f"start_{opts.replicas}_replicas_s": round(start_s, 2),
                      "in_process": in_process, "over_handle": over_ray}, indent=1))


if __name__ == "__main__":
    main()
