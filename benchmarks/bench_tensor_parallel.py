"""Tensor parallelism: the same workload on one rank and on `--tp-size` ranks, and where the
split costs.

Three measurements, in one run:
1. throughput: greedy decode (EOS ignored) at each `--batches` size, tokens/s after every
   request's first token, and one `--prefill-tokens` prompt with max_tokens=1 (prompt tokens/s),
   each on TP=1 and on TP=N (rank 0 in this process, the others spawned workers), with the
   TP=N/TP=1 ratio; also TP=1 with its layers unfused (`use_fused_decode = False`, as every
   tensor-parallel rank runs them), which separates the fused decoder's loss from the rest;
2. where a TP=N step goes: the group's collectives wrapped with timers on rank 0
   (`all_reduce`: two a layer, after o_proj and down_proj; `all_gather_last_dim`: the logits;
   `broadcast_object`: the step's SchedulerOutput on the control group), in microseconds a
   step and as a fraction of the step; the first all-reduce of a step is reported apart (it
   also waits for the workers to receive, unpickle and start the step), and the same
   collectives timed alone between two fresh processes give their transport cost;
3. communication volume per token against the arithmetic: the two all-reduces a layer of
   [tokens, hidden] float32 activations (the floor: what a Megatron split must move), the
   logits all-gather (vocab / N floats a rank per row), the pickled SchedulerOutput; in
   bytes per token, bytes sent per rank (a ring all-reduce sends 2 (N-1) / N of the tensor)
   and bytes per FLOP of a rank's share of the weights' arithmetic (2 x the weights a token
   uses: the decoder layers' projections and the output projection).
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import common as c

NAME = "tensor_parallel"
TITLE = "Tensor parallelism (TP=1 vs TP=2)"
COLLECTIVES = ("all_reduce", "all_gather_last_dim", "broadcast_object")


# ---- the workload ----------------------------------------------------------------------


class Prompts:
    """Prompts of their own for every run (no prefix-cache hit between runs)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.seed = 0

    def take(self, num_tokens: int) -> list[int]:
        self.seed += 1
        return c.prompt_token_ids(self.tokenizer, num_tokens, seed=self.seed)


def decode_run(engine: Any, prompts: Prompts, batch: int, prompt_tokens: int,
               new_tokens: int, on_step: Callable[[float], None] | None = None
               ) -> dict[str, Any]:
    """`batch` requests of `prompt_tokens` generate `new_tokens` greedily; the decode steps
    after every request's first token are timed (`on_step` gets each one's seconds)."""
    from loom import RequestOutputKind, SamplingParams

    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    ids = [f"tp-{prompts.seed}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, prompts.take(prompt_tokens), params)
    produced: dict[str, int] = defaultdict(int)
    while len(produced) < batch:  # the prompts' steps
        for out in engine.step():
            if out.outputs[0].token_ids:
                produced[out.request_id] += len(out.outputs[0].token_ids)
    first = sum(produced.values())
    start = c.now()
    steps = 0
    while engine.has_unfinished_requests():
        step_start = c.now()
        for out in engine.step():
            produced[out.request_id] += len(out.outputs[0].token_ids)
        steps += 1
        if on_step is not None:
            on_step(c.now() - step_start)
    seconds = c.now() - start
    tokens = sum(produced.values()) - first
    return {"tokens": tokens, "steps": steps, "seconds": seconds,
            "tok_s": tokens / seconds if seconds else None}


def prefill_run(engine: Any, prompts: Prompts, prompt_tokens: int) -> dict[str, Any]:
    """One prompt of `prompt_tokens`, max_tokens=1: prompt tokens/s to its first token."""
    from loom import SamplingParams

    engine.reset_prefix_cache()
    engine.add_request(f"tp-prefill-{prompts.seed}", prompts.take(prompt_tokens),
                       SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    start = c.now()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    seconds = c.now() - start
    return {"tokens": prompt_tokens, "steps": steps, "seconds": seconds,
            "tok_s": prompt_tokens / seconds}


def median_run(run: Callable[[], dict[str, Any]], repeats: int) -> dict[str, Any]:
    """The run with the median tokens/s of `repeats`, with every tokens/s."""
    runs = sorted((run() for _ in range(repeats)), key=lambda r: r["tok_s"] or 0.0)
    best = dict(runs[len(runs) // 2])
    best["all_tok_s"] = [round(r["tok_s"] or 0.0, 2) for r in runs]
    return best


# ---- timing the collectives on rank 0 --------------------------------------------------


class CollectiveTimer:
    """Wraps the group's collectives (instance attributes over its methods: the model's
    `RowParallelOutput` / `VocabParallelHead` and the executor call them through the same
    object) with perf_counter accumulators; `restore` removes the wrappers."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self._step_started = False
        for name in COLLECTIVES:
            setattr(group, name, self._wrap(name, getattr(group, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            key = name
            first = args[0] if args else next(iter(kwargs.values()), None)
            if name == "broadcast_object":
                size = len(pickle.dumps(first))
                self._step_started = True
            else:
                size = first.numel() * first.element_size()
                if name == "all_reduce" and self._step_started:
                    key, self._step_started = "all_reduce_first", False
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start
                self.calls[key] += 1
                self.bytes[key] += size
        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.bytes.clear()

    def restore(self) -> None:
        for name in COLLECTIVES:
            with contextlib.suppress(AttributeError):
                delattr(self.group, name)


def breakdown(timer: CollectiveTimer, step_seconds: list[float], tokens: int,
              label: str) -> dict[str, Any]:
    """Per-step microseconds of each collective and their share of the step."""
    steps = len(step_seconds)
    step_us = sum(step_seconds) * 1e6 / steps
    row: dict[str, Any] = {"workload": label, "steps": steps, "tokens": tokens,
                           "step_us": round(step_us, 1)}
    comm = 0.0
    for key in ("all_reduce_first", "all_reduce", "all_gather_last_dim", "broadcast_object"):
        us = timer.seconds.get(key, 0.0) * 1e6 / steps
        comm += us
        row[f"{key}_us"] = round(us, 1)
        row[f"{key}_calls"] = round(timer.calls.get(key, 0) / steps, 2)
        row[f"{key}_bytes"] = round(timer.bytes.get(key, 0) / steps)
        row[f"{key}_fraction"] = round(us / step_us, 4)
    row["comm_us"] = round(comm, 1)
    row["comm_fraction"] = round(comm / step_us, 4)
    row["rest_us"] = round(step_us - comm, 1)
    return row


def profiled_decode(engine: Any, timer: CollectiveTimer, prompts: Prompts, batch: int,
                    prompt_tokens: int, new_tokens: int) -> tuple[dict[str, Any], Any]:
    """One decode run with the collectives timed over its decode steps only; also its last
    decode step's SchedulerOutput (every request of the batch in it)."""
    from loom import RequestOutputKind, SamplingParams

    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    for i in range(batch):
        engine.add_request(f"tp-prof-{prompts.seed}-{i}", prompts.take(prompt_tokens), params)
    seen: set[str] = set()
    while len(seen) < batch:
        seen.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    timer.reset()
    step_seconds = []
    tokens = 0
    while engine.has_unfinished_requests():
        start = c.now()
        outs = engine.step()
        step_seconds.append(c.now() - start)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    row = breakdown(timer, step_seconds, tokens, f"decode, batch {batch}")
    return row, engine.last_scheduler_output


def profiled_prefill(engine: Any, timer: CollectiveTimer, prompts: Prompts,
                     prompt_tokens: int) -> tuple[dict[str, Any], Any]:
    """One prompt's steps with the collectives timed, and its first step's
    SchedulerOutput."""
    from loom import SamplingParams

    engine.reset_prefix_cache()
    engine.add_request(f"tp-prof-prefill-{prompts.seed}", prompts.take(prompt_tokens),
                       SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    timer.reset()
    step_seconds = []
    first = None
    while engine.has_unfinished_requests():
        start = c.now()
        engine.step()
        step_seconds.append(c.now() - start)
        first = first or engine.last_scheduler_output
    row = breakdown(timer, step_seconds, prompt_tokens, f"prefill, {prompt_tokens} tokens")
    return row, first


# ---- collectives alone, between two fresh processes -------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _median_us(fn: Callable[[], Any], iters: int) -> float:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(c.median(times) * 1e6, 1)


def _isolated_rank(rank: int, world: int, port: int, shapes: dict[str, Any], iters: int,
                   queue: Any) -> None:
    """One rank of the alone-timing (a spawned process, one thread, gloo on loopback)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    control = dist.new_group(backend="gloo")
    out: dict[str, float] = {}
    for label, (rows, hidden, vocab_shard, step) in shapes.items():
        x = torch.ones(rows, hidden)
        for _ in range(5):
            dist.all_reduce(x)
        dist.barrier()
        out[f"{label}/all_reduce"] = _median_us(lambda x=x: dist.all_reduce(x), iters)
        if vocab_shard:
            y = torch.ones(vocab_shard[0], vocab_shard[1])
            parts = [torch.empty_like(y) for _ in range(world)]
            dist.barrier()
            out[f"{label}/all_gather"] = _median_us(
                lambda y=y, parts=parts: dist.all_gather(parts, y), max(5, iters // 10))
        box = [step if rank == 0 else None]
        dist.barrier()
        out[f"{label}/broadcast"] = _median_us(
            lambda box=box: dist.broadcast_object_list(box, src=0, group=control),
            max(5, iters // 4))
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def isolated_collectives(world: int, shapes: dict[str, Any], iters: int) -> dict[str, float]:
    """Median microseconds (rank 0) of each step's collectives alone: `world` fresh
    processes that do nothing else, so no rank waits for another's compute."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_isolated_rank, args=(r, world, port, shapes, iters, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return result


# ---- volume against arithmetic ---------------------------------------------------------


def model_shape(engine: Any) -> dict[str, int]:
    """The whole model's shape (rank 0 of a split model keeps the whole config)."""
    cfg = engine.runner.model.config
    return {"layers": cfg.num_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size,
            "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "intermediate": int(cfg.text.get("intermediate_size") or 0)}


def volume(shape: dict[str, int], world: int, pickled: dict[str, int]) -> dict[str, Any]:
    """Bytes a decoded token moves against the FLOPs it takes (see the module docstring)."""
    layers, hidden, vocab = shape["layers"], shape["hidden"], shape["vocab"]
    q = shape["heads"] * shape["head_dim"]
    kv = shape["kv_heads"] * shape["head_dim"]
    layer_weights = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * shape["intermediate"]
    weights = layers * layer_weights + vocab * hidden
    flops = 2 * weights
    rank_flops = flops / world
    padded_vocab = -(-vocab // world) * world
    all_reduce = 2 * layers * hidden * 4  # float32 activations, two all-reduces a layer
    ring = 2 * (world - 1) / world
    rows = [("all-reduce (floor)", all_reduce, all_reduce * ring),
            ("all-gather of logits", padded_vocab * 4, padded_vocab // world * 4 * (world - 1))]
    for label, per_token in pickled.items():
        rows.append((f"broadcast, {label}", per_token, per_token * (world - 1)))
    out_rows = [{"what": what, "bytes_per_token": round(size),
                 "sent_per_rank_per_token": round(sent),
                 "bytes_per_flop": round(sent / rank_flops, 6)} for what, size, sent in rows]
    return {"weights_per_token": weights, "flops_per_token": flops,
            "flops_per_rank_per_token": rank_flops, "world": world, "rows": out_rows}


# ---- the run ---------------------------------------------------------------------------


def main() -> None:
    """TP=1 then TP=N on the same workload; collectives timed on rank 0; volumes."""
    parser = c.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tp-size", type=int, default=2, help="ranks of the split run")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="decode batch sizes (1 8; quick 1 4)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="decode prompts' length")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens generated per decode request (64; quick 16)")
    parser.add_argument("--prefill-tokens", type=int, default=None,
                        help="the prefill prompt's length (512; quick 128)")
    parser.add_argument("--iters", type=int, default=None,
                        help="iterations of each collective timed alone (200; quick 50)")
    parser.add_argument("--no-isolated", action="store_true",
                        help="skip timing the collectives alone")
    parser.add_argument("--no-unfused", action="store_true",
                        help="skip the TP=1 run with unfused layers")
    parser.add_argument("--preliminary", action="store_true",
                        help="mark the doc section preliminary (a busy host; also implied "
                             "by reduced sizes or repeats)")
    args = parser.parse_args()
    exact = str(args.quantization).lower() == "none"
    name = NAME + ("_float" if exact else "")
    title = TITLE.replace("TP=2", f"TP={args.tp_size}") + (", exact float32" if exact else "")
    if args.doc_only:
        return c.rerender(name, title, render)
    batches = args.batches or ([1, 4] if args.quick else [1, 8])
    new_tokens = args.max_tokens or (16 if args.quick else 64)
    prefill_tokens = args.prefill_tokens or (128 if args.quick else 512)
    repeats = args.repeats or (1 if args.quick else 3)
    iters = args.iters or (50 if args.quick else 200)
    world = args.tp_size
    max_len = max(args.prompt_tokens + new_tokens, prefill_tokens + 1) + 16
    sizing = {"max_num_seqs": max(batches), "max_model_len": max_len,
              "num_kv_blocks": (max(batches) + 1) * (max_len // 16 + 2) + 8,
              "max_num_batched_tokens": max(512, prefill_tokens)}

    throughput: dict[str, dict[str, Any]] = defaultdict(dict)
    startup: dict[str, float] = {}
    profile_rows: list[dict[str, Any]] = []
    step_outputs: dict[str, Any] = {}
    steps_us: dict[str, float] = {}
    shape: dict[str, int] = {}
    label = dtype = None

    def run_all(engine: Any, key: str, layers_only: bool = False) -> None:
        prompts = Prompts(engine.tokenizer)
        decode_run(engine, prompts, max(batches), args.prompt_tokens, 4)  # warm-up
        prefill_run(engine, prompts, min(64, prefill_tokens))
        for batch in batches:
            r = median_run(lambda b=batch: decode_run(engine, prompts, b, args.prompt_tokens,
                                                      new_tokens), repeats)
            throughput[f"decode, batch {batch}"][key] = r
            steps_us[f"{key}/decode, batch {batch}"] = r["seconds"] * 1e6 / r["steps"]
            c.log(f"{key}: decode batch {batch}: {r['tok_s']:.1f} tok/s "
                  f"({r['seconds'] * 1e3 / r['steps']:.2f} ms/step) {r['all_tok_s']}")
        r = median_run(lambda: prefill_run(engine, prompts, prefill_tokens), repeats)
        throughput[f"prefill, {prefill_tokens} tokens"][key] = r
        steps_us[f"{key}/prefill, {prefill_tokens} tokens"] = r["seconds"] * 1e6 / r["steps"]
        c.log(f"{key}: prefill {prefill_tokens}: {r['tok_s']:.1f} tok/s {r['all_tok_s']}")

    # TP=1 (and its layers unfused), then TP=N: one tensor-parallel group per process.
    start = c.now()
    engine = c.make_engine(args, tensor_parallel_size=1, **sizing)
    startup["tp1"] = round(c.now() - start, 2)
    try:
        label, dtype = c.engine_label(engine.config), engine.config.dtype
        shape = model_shape(engine)
        run_all(engine, "tp1")
        if not args.no_unfused:
            engine.runner.model.use_fused_decode = False
            run_all(engine, "tp1_unfused")
    finally:
        engine.shutdown()
        del engine

    start = c.now()
    engine = c.make_engine(args, tensor_parallel_size=world, **sizing)
    startup[f"tp{world}"] = round(c.now() - start, 2)
    c.log(f"TP={world} started in {startup[f'tp{world}']:.1f} s")
    try:
        run_all(engine, f"tp{world}")
        timer = CollectiveTimer(engine.executor.group)
        prompts = Prompts(engine.tokenizer)
        prompts.seed = 10_000
        for batch in batches:
            row, step = profiled_decode(engine, timer, prompts, batch, args.prompt_tokens,
                                        new_tokens)
            row["tp1_step_us"] = round(steps_us.get(f"tp1/decode, batch {batch}", 0.0), 1)
            profile_rows.append(row)
            step_outputs[row["workload"]] = step
        row, step = profiled_prefill(engine, timer, prompts, prefill_tokens)
        row["tp1_step_us"] = round(steps_us.get(f"tp1/{row['workload']}", 0.0), 1)
        profile_rows.append(row)
        step_outputs[row["workload"]] = step
        timer.restore()
    finally:
        engine.shutdown()
        del engine
    for row in profile_rows:
        c.log(f"TP={world} {row['workload']}: step {row['step_us']:.0f} us, all-reduce "
              f"{row['all_reduce_first_us'] + row['all_reduce_us']:.0f} us (first "
              f"{row['all_reduce_first_us']:.0f}), all-gather {row['all_gather_last_dim_us']:.0f}"
              f" us, broadcast {row['broadcast_object_us']:.0f} us: "
              f"{100 * row['comm_fraction']:.1f}% of the step")

    isolated: dict[str, float] = {}
    if not args.no_isolated:
        shapes: dict[str, Any] = {}
        shard = -(-shape["vocab"] // world)
        for batch in batches:
            shapes[f"decode, batch {batch}"] = (batch, shape["hidden"], (batch, shard),
                                                step_outputs[f"decode, batch {batch}"])
        key = f"prefill, {prefill_tokens} tokens"
        shapes[key] = (prefill_tokens, shape["hidden"], None, step_outputs[key])
        try:
            isolated = isolated_collectives(world, shapes, iters)
        except Exception as exc:
            c.skip(f"collectives alone: skipped ({type(exc).__name__}: {exc})")
        for key, us in isolated.items():
            c.log(f"alone: {key}: {us:.1f} us")

    pickled = {k: len(pickle.dumps(v)) for k, v in step_outputs.items()}
    per_token = {k: pickled[k] / max(1, v.num_batched_tokens)
                 for k, v in step_outputs.items() if k.startswith("decode")}
    result = c.header(
        name, args, dtype=dtype, mode=label, tp_size=world, batches=batches,
        prompt_tokens=args.prompt_tokens, max_tokens=new_tokens,
        prefill_tokens=prefill_tokens, repeats=repeats,
        preliminary=bool(args.preliminary or args.quick or new_tokens < 64 or prefill_tokens < 512
                         or repeats < 3),
        sizes_note=f"decode: batch {', '.join(map(str, batches))} x {args.prompt_tokens}-token "
                   f"prompts, {new_tokens} tokens greedy, EOS ignored; prefill: one "
                   f"{prefill_tokens}-token prompt, max_tokens=1; median of {repeats}",
        startup_s=startup, model_shape=shape,
        throughput=[{"workload": w, **{k: round(v["tok_s"], 2) for k, v in runs.items()},
                     f"ratio_tp{world}_tp1": c.ratio(runs[f"tp{world}"]["tok_s"],
                                                     runs["tp1"]["tok_s"]),
                     **({"ratio_unfused_tp1": c.ratio(runs["tp1_unfused"]["tok_s"],
                                                      runs["tp1"]["tok_s"])}
                        if "tp1_unfused" in runs else {}),
                     "runs": runs} for w, runs in throughput.items()],
        collectives=profile_rows, pickled_scheduler_output_bytes=pickled,
        isolated_collectives_us=isolated,
        volume=volume(shape, world, per_token),
    )
    c.log("\n" + render(result))
    c.finish(name, title, result, render, args.no_doc)


def render(result: dict[str, Any]) -> str:
    """The doc section: throughput ratios, the step's collectives, volume per token."""
    n = result["tp_size"]
    unfused = any("tp1_unfused" in r for r in result["throughput"])
    cols = ["workload", "TP=1 tok/s"] + (["TP=1 unfused tok/s"] if unfused else []) + [
        f"TP={n} tok/s", f"TP={n} / TP=1"]
    rows = [[r["workload"], r["tp1"], *([r.get("tp1_unfused")] if unfused else []),
             r[f"tp{n}"], r[f"ratio_tp{n}_tp1"]] for r in result["throughput"]]
    t1 = c.markdown_table(cols, rows)
    iso = result.get("isolated_collectives_us") or {}
    t2 = c.markdown_table(
        [f"workload (TP={n}, rank 0)", "step µs", "TP=1 step µs", "all-reduce µs (calls)",
         "µs a call", "of it the first", "all-gather µs", "broadcast µs", "collectives share",
         "all-reduce alone µs (one)"],
        [(r["workload"], r["step_us"], r.get("tp1_step_us"),
          f"{r['all_reduce_first_us'] + r['all_reduce_us']:,.0f} "
          f"({r['all_reduce_first_calls'] + r['all_reduce_calls']:g})",
          (r["all_reduce_first_us"] + r["all_reduce_us"])
          / max(1.0, r["all_reduce_first_calls"] + r["all_reduce_calls"]),
          r["all_reduce_first_us"], r["all_gather_last_dim_us"], r["broadcast_object_us"],
          f"{100 * r['comm_fraction']:.1f}%", iso.get(f"{r['workload']}/all_reduce"))
         for r in result["collectives"]])
    vol = result["volume"]
    t3 = c.markdown_table(
        ["per decoded token", "bytes", f"sent per rank (N={n})", "bytes / FLOP of a rank"],
        [(r["what"], f"{r['bytes_per_token']:,}", f"{r['sent_per_rank_per_token']:,}",
          f"{r['bytes_per_flop']:.2e}") for r in vol["rows"]])
    alone = ", ".join(f"{k}: {v:,.0f} µs" for k, v in iso.items()
                      if not k.endswith("/all_reduce")) or "not measured"
    prelim = ("**Preliminary** (reduced sizes or repeats; a smoke run on a shared host, "
              "not the final figures).\n\n" if result.get("preliminary") else "")
    intro = (f"The same workload on one rank and on {n} (Megatron split over torch.distributed, "
             "gloo on a CPU): greedy decode tok/s after the prompts' step and one prompt's "
             "prefill tok/s; where a split step's time goes (the collectives timed on rank 0); "
             "and the bytes a decoded token moves against the FLOPs it takes.\n\n")
    return (
        f"{prelim}{intro}{t1}\n\n{t2}\n\n{t3}\n\n"
        f"Mode {result.get('mode')}; start-up {result['startup_s']} s. TP={n} runs rank 0 in "
        f"the calling process and {n - 1} spawned worker(s), each with cores / {n} threads; "
        "TP=1 uses every core, so on a CPU host the split gains no arithmetic and the "
        "ratio shows what the split costs. \"TP=1 unfused\" is TP=1 with "
        "`use_fused_decode = False`, the layer path every tensor-parallel rank runs. "
        "Collectives are timed on rank 0 around `TensorParallelGroup.all_reduce` / "
        "`all_gather_last_dim` / `broadcast_object` over the decode steps (after the "
        "prompts' step); a rank-0 collective includes waiting for the other ranks, and the "
        "first all-reduce of a step also waits while the workers receive, unpickle and "
        "start the step. \"Alone\" is the same collective between two fresh processes "
        f"doing nothing else (median); others alone: {alone}. "
        f"FLOPs per token: 2 x {vol['weights_per_token']:,} weights "
        f"= {vol['flops_per_token'] / 1e6:,.0f} MFLOP ({vol['flops_per_rank_per_token'] / 1e6:,.0f}"
        " a rank; attention over the context excluded). The floor is the two all-reduces a "
        "layer of float32 [tokens, hidden] activations that a Megatron split must move; a "
        "ring all-reduce sends 2 (N-1)/N of the tensor per rank. The broadcast rows are the "
        "pickled SchedulerOutput of a step over its tokens."
        + c.skip_notes_md(result)
    )


if __name__ == "__main__":
    main()
