"""Run every benchmark (each in its own process), then the plots: `make bench`.

    python benchmarks/run_all.py            # full sizes
    python benchmarks/run_all.py --quick    # small sizes, a few minutes each
    python benchmarks/run_all.py --only latency sessions -- --no-llama-cpp

Arguments after `--` are passed to every benchmark.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = ["startup", "latency", "throughput", "sessions", "hooks", "quality", "speculative",
              "prefix", "kv_connector", "serving", "step_profile", "tensor_parallel",
              "model_sizes"]


def main() -> int:
    """Run the chosen benchmarks one after another; a failing one does not stop the rest."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, default=BENCHMARKS)
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="-- args for every benchmark")
    args = parser.parse_args()
    extra = [a for a in args.extra if a != "--"]
    failed = []
    for name in args.only:
        cmd = [sys.executable, str(HERE / f"bench_{name}.py"), *(["--quick"] * args.quick),
               *extra]
        print(f"== {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        code = subprocess.call(cmd)
        took = time.perf_counter() - start
        print(f"== {name}: exit {code} after {took:.0f} s (JSON in benchmarks/results/)",
              file=sys.stderr, flush=True)
        if code:
            failed.append(name)
    subprocess.call([sys.executable, str(HERE / "plot.py")])
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
