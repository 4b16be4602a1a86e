"""Engine replicas on Ray Serve behind Loom's OpenAI server: agent conversations on the
Responses API, one engine against two replicas, Loom's router against Ray Serve's default
(power of two choices), and a replica killed mid-conversation (issue 44).

    python benchmarks/bench_replicas.py           # smollm2-135m-instruct
    python benchmarks/bench_replicas.py --quick   # the tests' tiny random Gemma 3: a smoke run
    python benchmarks/bench_replicas.py --model PATH --conversations 32 --turns 6 --kill-after 3

The workload: `--conversations` agent conversations at once (httpx, one connection each),
`--turns` turns each, over the real HTTP server (`build_app` over the engine client, uvicorn
on a free loopback port). Every turn posts `/v1/responses` with the shared ~300-token system
prompt as `instructions`, a user message of 40-80 tokens (the first turn: a per-conversation
opener too) and, after the first, `previous_response_id`; greedy, `max_output_tokens` 16,
not streamed (a turn's latency is the whole response). The same requests, in the same phases
(turns 1..kill-after for every conversation, then the rest), go to each configuration:

- `a`: in process, one engine with 2 compute threads;
- `b`: 2 replicas x 1 thread on Ray Serve, Loom's router, sharing a folder store
  (`SharedStorageConnector`); after turn `--kill-after` the replica serving most
  conversations is killed (`ray.kill` of its actor) before the next turns;
- `c`: as `b` with Ray Serve's default router (`start_replicas(router="power_of_two")`),
  nothing killed.

Per configuration: the share of input tokens served from cache (the sum of
`usage.input_tokens_details.cached_tokens` over the sum of `input_tokens`), turn latency
p50 / p99 (before the kill: turns 1..kill-after; and over every turn), throughput, 5xx
answers, lost turns (any non-200 or transport error; a conversation stops at its first),
the turns whose output text differs from `a`'s, and the replica of each turn
(`x-loom-replica`). For the kill: the latency of the first turn of each moved conversation
(those whose last turn before the kill was served by the killed replica) against the median
turn before the kill and the median of the other conversations' first turn after it, and the
conversations lost. Also the start-up of each configuration and the round trip of an engine
call (`--calls`: `holds` and a one-token `append`) in process and over the handle.

Writes `benchmarks/results/replicas.json` (`--out` to change; the host is named in it) and
prints a markdown table on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import common as c  # noqa: E402

DEFAULT_MODEL = "smollm2-135m-instruct"  # `loom serve`'s default: a chat model
SERVED_NAME = "bench"
CONFIGS = {
    "a": "in process, 1 engine x 2 threads",
    "b": "2 replicas x 1 thread, Loom router",
    "c": "2 replicas x 1 thread, power-of-two router",
}
REPLICA_HEADER = "x-loom-replica"

# ---- the conversations -----------------------------------------------------------------

_TEXT = (
    "the agent reads a file and checks every function that the parser calls before it "
    "writes a short summary of the tests which failed on the last build because a new "
    "import moved the cache of tokens into another module so the server now returns an "
    "error when a client sends a request with an empty list of tools please look at the "
    "log again and tell me which line raised first then propose a small patch that keeps "
    "the old behaviour for callers who pass a string instead of a list of messages"
)
_WORDS = _TEXT.split()

_SYSTEM_HEAD = (
    "You are a careful coding assistant working inside a large Python repository. You answer "
    "in short, precise sentences. You never invent file names or functions: when you are not "
    "sure, you say so and ask for the file. When the user pastes an error, you first name the "
    "line that raised it, then the cause, then the smallest fix. You keep the existing style "
    "of the code, you do not reformat unrelated lines, and you mention every test that the "
    "change touches. "
)


def words_of(tokenizer: Any, target: int, rng: random.Random) -> str:
    """A sentence of the benchmark's words of about `target` tokens (by `tokenizer`)."""
    out: list[str] = []
    while len(tokenizer.encode(" ".join(out), add_special_tokens=False)) < target:
        start = rng.randrange(len(_WORDS))
        out.extend(_WORDS[start:start + rng.randint(3, 9)])
    return " ".join(out)


def build_workload(tokenizer: Any, conversations: int, turns: int, system_tokens: int,
                   user_tokens: tuple[int, int], seed: int = 0) -> dict[str, Any]:
    """The system prompt and each conversation's user messages (deterministic)."""
    rng = random.Random(seed)
    system = ""
    for word in _SYSTEM_HEAD.split():
        if len(tokenizer.encode(system, add_special_tokens=False)) >= system_tokens:
            break
        system = f"{system} {word}".lstrip()
    while len(tokenizer.encode(system, add_special_tokens=False)) < system_tokens:
        system += " " + words_of(tokenizer, 24, rng) + "."
    convs = []
    for i in range(conversations):
        crng = random.Random(seed * 1_000_003 + i)
        opener = f"Conversation {i}: I work on module number {crng.randrange(10_000)}. "
        msgs = [words_of(tokenizer, crng.randint(*user_tokens), crng) for _ in range(turns)]
        msgs[0] = opener + msgs[0]
        convs.append(msgs)
    return {"system": system, "conversations": convs,
            "system_tokens": len(tokenizer.encode(system, add_special_tokens=False))}


# ---- the server --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def http_server(engine: Any, sessions: int, chat_template: str | None = None):
    """Loom's OpenAI server over `engine` (an engine client) on a free loopback port, in a
    thread; yields its base URL."""
    import uvicorn

    from loom.server.app import build_app
    from loom.server.state import ServerConfig

    app = build_app(engine, ServerConfig(served_model_name=SERVED_NAME,
                                         max_sessions_per_key=max(64, sessions),
                                         chat_template=chat_template))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


# ---- the agent loop -------------------------------------------------------------------------


async def one_turn(http: Any, work: dict[str, Any], conv: int, turn: int,
                   previous: str | None, max_output: int) -> dict[str, Any]:
    """Post one turn; its record (status, latency, usage, replica, text or error)."""
    body: dict[str, Any] = {"model": SERVED_NAME, "instructions": work["system"],
                            "input": work["conversations"][conv][turn],
                            "max_output_tokens": max_output, "temperature": 0}
    if previous is not None:
        body["previous_response_id"] = previous
    rec: dict[str, Any] = {"conv": conv, "turn": turn + 1}
    began = time.perf_counter()
    try:
        resp = await http.post("/v1/responses", json=body)
    except Exception as error:  # a transport error or a timeout: the turn is lost
        rec.update(status=None, latency_s=time.perf_counter() - began,
                   error=f"{type(error).__name__}: {error}"[:300])
        return rec
    rec.update(status=resp.status_code, latency_s=time.perf_counter() - began,
               replica=resp.headers.get(REPLICA_HEADER))
    if resp.status_code != 200:
        rec["error"] = resp.text[:300]
        return rec
    data = resp.json()
    usage = data.get("usage") or {}
    rec.update(id=data["id"], input_tokens=usage.get("input_tokens", 0),
               cached_tokens=(usage.get("input_tokens_details") or {}).get("cached_tokens", 0),
               output_tokens=usage.get("output_tokens", 0),
               text="".join(part.get("text", "") for item in data.get("output", [])
                            for part in item.get("content", []) or []))
    return rec


async def run_phase(base_url: str, work: dict[str, Any], turns: range,
                    previous: dict[int, str | None], alive: set[int], max_output: int,
                    timeout_s: float) -> tuple[list[dict[str, Any]], float]:
    """Every live conversation runs `turns` (its turns one after another, the conversations at
    once); `previous` and `alive` are updated. The records, and the phase's wall time."""
    import httpx

    records: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=len(work["conversations"]) + 4,
                          max_keepalive_connections=len(work["conversations"]) + 4)

    async def conversation(http: Any, conv: int) -> None:
        for turn in turns:
            rec = await one_turn(http, work, conv, turn, previous[conv], max_output)
            records.append(rec)
            if rec.get("status") != 200:
                alive.discard(conv)
                return
            previous[conv] = rec["id"]

    began = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as http:
        await asyncio.gather(*(conversation(http, i) for i in sorted(alive)))
    wall = time.perf_counter() - began
    failed = [r for r in records if r.get("status") != 200]
    if failed:
        c.log(f"  {len(failed)} turns failed, the first: {failed[0]}")
    return records, wall


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (linear interpolation), None when empty."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarise(records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Cache share, latency p50 / p99 (ms), throughput, 5xx and failures of some turns."""
    ok = [r for r in records if r.get("status") == 200]
    lat = [r["latency_s"] * 1e3 for r in ok]
    inputs = sum(r["input_tokens"] for r in ok)
    return {
        "turns": len(records), "turns_ok": len(ok),
        "cache_share": round(sum(r["cached_tokens"] for r in ok) / inputs, 4) if inputs else None,
        "input_tokens": inputs, "cached_tokens": sum(r["cached_tokens"] for r in ok),
        "output_tokens": sum(r["output_tokens"] for r in ok),
        "p50_ms": _r(percentile(lat, 0.5)), "p99_ms": _r(percentile(lat, 0.99)),
        "mean_ms": _r(statistics.fmean(lat)) if lat else None,
        "wall_s": round(wall_s, 2),
        "turns_per_s": round(len(ok) / wall_s, 3) if wall_s else None,
        "output_tok_per_s": round(sum(r["output_tokens"] for r in ok) / wall_s, 2)
        if wall_s else None,
        "http_5xx": sum(1 for r in records if (r.get("status") or 0) >= 500),
        "failed": sum(1 for r in records if r.get("status") != 200),
    }


def _r(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


# ---- the configurations -------------------------------------------------------------------


def engine_args(model: str, quick: bool, store: Path | None) -> Any:
    from loom.engine.config import EngineArgs

    extra: dict[str, Any] = {}
    if store is not None:
        extra["kv_transfer_config"] = {
            "kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    if quick:  # the tests' tiny model: float32, small blocks
        return EngineArgs(model=model, dtype="float32", device="cpu", num_kv_blocks=2048,
                          block_size=4, session_ttl_s=None, max_step_ms=100.0, **extra)
    return EngineArgs(model=model, device="cpu", session_ttl_s=None, max_step_ms=100.0, **extra)


async def per_call_ms(client: Any, calls: int, append: bool = True) -> dict[str, float]:
    """Median ms of `holds` and (unless `append` is False: a router that ignores pins sends
    a session's appends to either replica) of a one-token `append` to a paused session."""
    await client.add_request("bench-calls", [2, 5, 6, 7, 8, 9, 10, 11], None, session=True)
    timings: dict[str, list[float]] = {"holds": [], **({"append": []} if append else {})}
    for i in range(calls):
        began = time.perf_counter()
        await client.holds("bench-calls")
        timings["holds"].append(time.perf_counter() - began)
        if append:
            began = time.perf_counter()
            await client.append("bench-calls", [12 + i % 50])
            timings["append"].append(time.perf_counter() - began)
    await client.close("bench-calls")
    return {f"{k}_ms": round(statistics.median(v) * 1e3, 3) for k, v in timings.items()}


def replica_actor(app: str, replica: str) -> Any:
    import ray

    from loom.distributed.launch import DEPLOYMENT

    return ray.get_actor(f"SERVE_REPLICA::{app}#{DEPLOYMENT}#{replica}", namespace="serve")


def run_config(name: str, opts: argparse.Namespace, work: dict[str, Any],
               tmp: Path) -> dict[str, Any]:
    """One configuration: start it, run the phases (killing a replica between them in `b`),
    measure, shut it down."""
    import torch

    out: dict[str, Any] = {"config": name, "label": CONFIGS[name]}
    began = time.perf_counter()
    if name == "a":
        from loom.engine.async_engine import AsyncLLMEngine

        torch.set_num_threads(2)
        args = engine_args(opts.model, opts.quick, None)
        if opts.calls:  # measured on a throwaway engine: the server's loop owns the other
            probe = AsyncLLMEngine.from_engine_args(args)
            out["per_call"] = asyncio.run(per_call_ms(probe, opts.calls))
            probe.shutdown()
            began = time.perf_counter()
        engine = AsyncLLMEngine.from_engine_args(args)
        app = None
    else:
        from loom.distributed.launch import start_replicas

        store = tmp / f"kv-{name}"
        store.mkdir()
        app = f"bench-{name}"
        engine = start_replicas(engine_args(opts.model, opts.quick, store), 2, app_name=app,
                                threads=1, num_cpus=1,
                                router="loom" if name == "b" else "power_of_two",
                                graceful_shutdown_timeout_s=5)
        if opts.calls:
            out["per_call"] = asyncio.run(per_call_ms(engine, opts.calls, append=name == "b"))
    out["start_s"] = round(time.perf_counter() - began, 2)
    out["mode"] = engine.config.mode_summary
    c.log(f"[{name}] {CONFIGS[name]}: started in {out['start_s']} s")
    convs = len(work["conversations"])
    previous: dict[int, str | None] = dict.fromkeys(range(convs))
    alive = set(range(convs))
    try:
        with http_server(engine, convs * (opts.turns + 1), opts.chat_template) as url:
            first, wall1 = asyncio.run(run_phase(url, work, range(opts.kill_after), previous,
                                                 alive, opts.max_output_tokens,
                                                 opts.turn_timeout_s))
            c.log(f"[{name}] turns 1-{opts.kill_after}: {wall1:.1f} s")
            kill: dict[str, Any] | None = None
            if name == "b" and opts.kill:
                kill = kill_busiest(app, first, opts.kill_after)
            second, wall2 = asyncio.run(run_phase(url, work, range(opts.kill_after, opts.turns),
                                                  previous, alive, opts.max_output_tokens,
                                                  opts.turn_timeout_s))
            c.log(f"[{name}] turns {opts.kill_after + 1}-{opts.turns}: {wall2:.1f} s")
    finally:
        engine.shutdown()
    records = first + second
    out["before_kill" if name == "b" and opts.kill else "first_turns"] = summarise(first, wall1)
    out["all_turns"] = summarise(records, wall1 + wall2)
    out["conversations_lost"] = convs - len(alive)
    out["errors"] = sorted({r["error"][:200] for r in records if r.get("error")})[:10]
    out["replica_turns"] = _count(r.get("replica") for r in records if r.get("status") == 200)
    out["replicas_per_conversation"] = _replicas_per_conversation(records)
    if kill is not None:
        out["kill"] = kill_report(kill, first, second, opts.kill_after)
    out["records"] = [{k: v for k, v in r.items() if k != "id"} for r in records]
    return out


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in values:
        counts[str(v)] = counts.get(str(v), 0) + 1
    return counts


def _replicas_per_conversation(records: list[dict[str, Any]]) -> dict[str, int]:
    """How many conversations had their turns served by 1, 2, ... distinct replicas."""
    seen: dict[int, set[str]] = {}
    for r in records:
        if r.get("status") == 200 and r.get("replica"):
            seen.setdefault(r["conv"], set()).add(r["replica"])
    return _count(len(s) for s in seen.values())


def kill_busiest(app: str, first: list[dict[str, Any]],
                 kill_after: int) -> dict[str, Any] | None:
    """Kill the replica that served the most conversations' last turn before the kill."""
    import ray

    last = {r["conv"]: r.get("replica") for r in first
            if r["turn"] == kill_after and r.get("status") == 200}
    counts = _count(v for v in last.values() if v)
    if not counts:
        c.log("no conversation reached the kill: nothing killed")
        return None
    victim = sorted(counts, key=lambda k: (-counts[k], k))[0]
    began = time.perf_counter()
    ray.kill(replica_actor(app, victim), no_restart=True)
    c.log(f"killed replica {victim} ({counts[victim]} of {len(last)} conversations on it)")
    return {"replica": victim, "conversations_on_it": counts[victim],
            "moved": sorted(k for k, v in last.items() if v == victim),
            "kill_call_s": round(time.perf_counter() - began, 3)}


def kill_report(kill: dict[str, Any], first: list[dict[str, Any]],
                second: list[dict[str, Any]], kill_after: int) -> dict[str, Any]:
    """The moved conversations' first turn after the kill against a normal turn."""
    moved = set(kill["moved"])
    nxt = kill_after + 1
    normal = [r["latency_s"] for r in first if r.get("status") == 200]
    moved_first = [r for r in second if r["turn"] == nxt and r["conv"] in moved]
    others_first = [r["latency_s"] for r in second
                    if r["turn"] == nxt and r["conv"] not in moved and r.get("status") == 200]
    ok = [r for r in moved_first if r.get("status") == 200]
    lat = [r["latency_s"] for r in ok]
    normal_ms = statistics.median(normal) * 1e3 if normal else None
    others_ms = statistics.median(others_first) * 1e3 if others_first else None
    worst = max(lat) * 1e3 if lat else None
    inputs = sum(r["input_tokens"] for r in ok)
    return {
        **kill,
        "moved_count": len(moved),
        "moved_first_turn_ok": len(ok),
        "moved_first_turn_p50_ms": _r(percentile([x * 1e3 for x in lat], 0.5)),
        "moved_first_turn_max_ms": _r(worst),
        "normal_turn_p50_ms": _r(normal_ms),
        "others_first_turn_p50_ms": _r(others_ms),
        "moved_max_over_normal": round(worst / normal_ms, 2) if worst and normal_ms else None,
        "moved_p50_over_normal": round(statistics.median(lat) * 1e3 / normal_ms, 2)
        if lat and normal_ms else None,
        "moved_cache_share": round(sum(r["cached_tokens"] for r in ok) / inputs, 4)
        if inputs else None,
        "moved_served_by": _count(r.get("replica") for r in ok),
        "moved_lost": len(moved) - len(ok),
    }


def compare_texts(results: dict[str, Any]) -> None:
    """Per configuration: the turns whose output text differs from configuration a's."""
    if "a" not in results:
        return
    ref = {(r["conv"], r["turn"]): r.get("text") for r in results["a"]["records"]
           if r.get("status") == 200}
    for res in results.values():
        both = [(r, ref[(r["conv"], r["turn"])]) for r in res["records"]
                if r.get("status") == 200 and (r["conv"], r["turn"]) in ref]
        res["texts_compared"] = len(both)
        res["texts_differ_from_a"] = sum(1 for r, t in both if r.get("text") != t)


def table(results: dict[str, Any]) -> str:
    """The markdown table of the results."""
    rows = []
    base = results.get("a", {}).get("all_turns", {}).get("cache_share")
    for name, res in results.items():
        s, pre = res["all_turns"], res.get("before_kill") or res.get("first_turns") or {}
        share = s["cache_share"]
        rows.append([CONFIGS[name], share,
                     None if share is None or base is None else round(share - base, 4),
                     pre.get("p50_ms"), pre.get("p99_ms"), s["p50_ms"], s["p99_ms"],
                     s["turns_per_s"], s["http_5xx"], s["failed"], res["conversations_lost"],
                     res.get("texts_differ_from_a"), res["start_s"]])
    return c.markdown_table(
        ["configuration", "cache share", "vs a", "p50 ms (1-3)", "p99 ms (1-3)", "p50 ms (all)",
         "p99 ms (all)", "turns/s", "5xx", "failed turns", "conversations lost",
         "texts != a", "start s"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help=f"Loom model name or path (default {DEFAULT_MODEL}; "
                             "--quick: the tests' tiny random Gemma 3)")
    parser.add_argument("--quick", action="store_true", help="tiny random model, 8 x 4 turns")
    parser.add_argument("--configs", default="abc", help="which of a, b, c to run (default abc)")
    parser.add_argument("--conversations", type=int, default=None, help="default 32 (quick 8)")
    parser.add_argument("--turns", type=int, default=None, help="default 6 (quick 4)")
    parser.add_argument("--kill-after", type=int, default=None,
                        help="turns before the kill (default 3; quick 2)")
    parser.add_argument("--no-kill", dest="kill", action="store_false",
                        help="do not kill a replica in b")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja file for a model without a chat template")
    parser.add_argument("--system-tokens", type=int, default=None,
                        help="default 300 (quick 60)")
    parser.add_argument("--user-tokens", type=int, nargs=2, default=None,
                        help="a user message's tokens, low high (default 40 80; quick 8 16)")
    parser.add_argument("--max-output-tokens", type=int, default=None,
                        help="default 16 (quick 8)")
    parser.add_argument("--turn-timeout-s", type=float, default=60.0,
                        help="a turn not answered by then is lost")
    parser.add_argument("--calls", type=int, default=50,
                        help="engine calls timed in process and over the handle (0: none)")
    parser.add_argument("--out", default=None, help="JSON path (default results/replicas.json)")
    opts = parser.parse_args()
    opts.conversations = opts.conversations or (8 if opts.quick else 32)
    opts.turns = opts.turns or (4 if opts.quick else 6)
    opts.kill_after = opts.kill_after or (2 if opts.quick else 3)
    opts.system_tokens = opts.system_tokens or (60 if opts.quick else 300)
    opts.user_tokens = tuple(opts.user_tokens or ((8, 16) if opts.quick else (40, 80)))
    opts.max_output_tokens = opts.max_output_tokens or (8 if opts.quick else 16)
    if not 0 < opts.kill_after < opts.turns:
        raise SystemExit("--kill-after must be between 1 and --turns - 1")
    import ray

    from loom.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        if opts.model is None:
            if opts.quick:
                from tiny_reference import build_tiny_model

                from loom.tokenizer.packaged_templates import (
                    GEMMA3_TEMPLATE,
                    packaged_template_file,
                )

                build_tiny_model("gemma3", tmp / "gemma3")
                opts.model = str(tmp / "gemma3")
                # The tiny tokenizer has no chat template: Loom's packaged Gemma 3 one.
                opts.chat_template = opts.chat_template or str(
                    packaged_template_file(GEMMA3_TEMPLATE))
            else:
                opts.model = DEFAULT_MODEL
        work = build_workload(load_tokenizer(c.model_path(opts.model)), opts.conversations,
                              opts.turns, opts.system_tokens, opts.user_tokens)
        c.log(f"{opts.conversations} conversations x {opts.turns} turns, system prompt "
              f"{work['system_tokens']} tokens, model {opts.model}")
        results: dict[str, Any] = {}
        ray_init_s = None
        for name in opts.configs:
            if name not in CONFIGS:
                raise SystemExit(f"unknown configuration {name!r}")
            if name != "a" and not ray.is_initialized():
                began = time.perf_counter()
                ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
                ray_init_s = round(time.perf_counter() - began, 2)
            results[name] = run_config(name, opts, work, tmp)
            shutil.rmtree(tmp / f"kv-{name}", ignore_errors=True)
        if ray.is_initialized():
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    compare_texts(results)
    result = {
        "benchmark": "replicas",
        "command": c.command_line(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": c.machine_info(),
        "model": opts.model if not opts.quick else "tiny random gemma3 (tests)",
        "quick": opts.quick,
        "workload": {"conversations": opts.conversations, "turns": opts.turns,
                     "kill_after": opts.kill_after, "system_tokens": work["system_tokens"],
                     "max_output_tokens": opts.max_output_tokens,
                     "user_message_tokens": list(opts.user_tokens)},
        "ray_init_s": ray_init_s,
        "configs": results,
    }
    path = Path(opts.out) if opts.out else c.RESULTS_DIR / "replicas.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    summary = {k: {kk: vv for kk, vv in v.items() if kk != "records"} for k, v in results.items()}
    print(json.dumps(summary, indent=1, default=str))
    c.log("\n" + table(results))
    c.log(f"wrote {path}")


if __name__ == "__main__":
    main()
