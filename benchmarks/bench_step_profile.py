"""Where a decode step's time goes: its wall time against its device time, from a profile.

One or more requests (`--batch`) are prefilled to `--context` tokens, warmed up, then
`--steps` decode steps are timed (wall, each step ending with the sampled tokens on the
host) and `--profile-steps` more run under `torch.profiler`. On a GPU the profile gives the
device time of a step (the sum of its kernels' time) and the number of kernel launches; a
launch-bound step has a wall time many times its device time (the CUDA path's target: at
most 2x). On a CPU the device time is the step's own operators, so the table lists the top
operators by self time instead.
"""

from __future__ import annotations

from typing import Any

import common as c

NAME = "step_profile"
TITLE = "Decode step profile: wall time against device time"


def _device_time_us(event: Any) -> float:
    """An averaged profiler event's self time on the device (the field was renamed)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_steps(engine: Any, steps: int) -> dict[str, Any]:
    """Run `steps` engine steps under torch.profiler: device ms and launches per step, and
    the top operators (by device time on a GPU, by CPU self time otherwise)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        c.device_sync()
    events = prof.key_averages()
    if cuda:
        kernels = [e for e in events if _device_time_us(e) > 0]
        device_us = sum(_device_time_us(e) for e in kernels)
        launches = sum(e.count for e in kernels)
        top = sorted(kernels, key=_device_time_us, reverse=True)[:10]
        top_rows = [(e.key, _device_time_us(e) / steps / 1e3, e.count / steps) for e in top]
    else:
        device_us, launches = None, None
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
        top_rows = [(e.key, e.self_cpu_time_total / steps / 1e3, e.count / steps) for e in top]
    return {
        "device_ms_per_step": None if device_us is None else round(device_us / steps / 1e3, 3),
        "launches_per_step": None if launches is None else round(launches / steps, 1),
        "top_ops": [{"name": n, "ms_per_step": round(ms, 3), "calls_per_step": round(k, 1)}
                    for n, ms, k in top_rows],
    }


def main() -> None:
    """Parse arguments, prefill, time and profile decode steps, report."""
    from loom import SamplingParams

    parser = c.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512, help="tokens before decoding")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    parser.add_argument("--mode", default="default",
                        help="Loom variant (common.loom_mode_kwargs: default+cublas, ...)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (64; quick 8)")
    parser.add_argument("--profile-steps", type=int, default=None,
                        help="profiled steps (16; quick 4)")
    args = parser.parse_args()
    if args.doc_only:
        return c.rerender(NAME, TITLE, render)
    steps = args.steps or (8 if args.quick else 64)
    profiled = args.profile_steps or (4 if args.quick else 16)
    warmup = 8
    engine = c.make_engine(args, max_num_seqs=max(args.batch, 1),
                           **c.loom_mode_kwargs(args.mode))
    params = SamplingParams(temperature=0.0, ignore_eos=True,
                            max_tokens=warmup + steps + profiled + 8)
    for i in range(args.batch):
        engine.add_request(f"p{i}", c.prompt_token_ids(engine.tokenizer, args.context,
                                                       seed=500 + i), params)
    # Prefill (and the first token), then warm the decode path (graphs, caches).
    started: set[str] = set()
    while len(started) < args.batch:
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    for _ in range(warmup):
        engine.step()
    c.device_sync()
    times = []
    for _ in range(steps):
        start = c.now()
        engine.step()  # returns once the step's tokens are on the host
        times.append((c.now() - start) * 1e3)
    prof = profile_steps(engine, profiled)
    wall = c.median(times)
    device = prof["device_ms_per_step"]
    result = c.header(
        NAME, args, dtype=engine.config.dtype, mode=engine.config.mode_summary,
        sizes_note=f"batch {args.batch} at {args.context} tokens of context, "
                   f"{steps} timed steps, {profiled} profiled",
        context=args.context, batch=args.batch, wall_ms_per_step=round(wall, 3),
        wall_ms_all=[round(t, 3) for t in times],
        wall_over_device=c.ratio(wall, device), **prof,
    )
    c.finish(NAME, TITLE, result, render, args.no_doc)


def render(result: dict[str, Any]) -> str:
    """The doc section's body: the step's figures, then its top operators."""
    head = c.markdown_table(
        ["mode", "wall ms / step", "device ms / step", "wall / device", "launches / step"],
        [[result.get("mode"), result["wall_ms_per_step"], result["device_ms_per_step"],
          result["wall_over_device"], result["launches_per_step"]]],
    )
    ops = c.markdown_table(["operator", "ms / step", "calls / step"],
                           [[f"`{o['name']}`", o["ms_per_step"], o["calls_per_step"]]
                            for o in result["top_ops"]])
    basis = "device time" if result["device_ms_per_step"] is not None else "CPU self time"
    return f"{head}\n\nTop operators by {basis}:\n\n{ops}"


if __name__ == "__main__":
    main()
