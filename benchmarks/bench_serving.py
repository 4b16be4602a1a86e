"""Online serving: `loom serve` against llama.cpp's server, over HTTP, as clients see them.

vLLM's `benchmark_serving` shape. Each server runs as a subprocess on a free loopback port,
on the same GGUF file (Loom: `python -m loom.cli serve`, dtype auto, continuous batching;
llama.cpp: `python -m llama_cpp.server` from llama-cpp-python, which runs one sequence at a
time and queues the rest). One server at a time, so they never share the CPU; the client
(asyncio + httpx, streaming over SSE) runs beside the server on the same machine.

- Completions: `--num-prompts` prompts of `--input-tokens` random words (fixed seed) each
  generate `--output-tokens` greedy tokens (`min_tokens` = `max_tokens`, so lengths are equal
  on both servers; the counts reported come from the stream), sent with Poisson arrivals at
  each of `--rates` requests per second ("inf": all at once). Per server and rate: completed
  requests, duration, request and output-token throughput, TTFT, TPOT (time per output token
  after the first) and ITL (gaps between streamed chunks), p50 and p99, measured client-side.
  Each rate gets its own prompts (so no rate finds the previous one's prompts cached); both
  servers get the same prompts and arrival times.
- Agents: `--agents` concurrent agents run `--turns` turns each; a turn appends a
  `--tool-tokens` "tool result" to the agent's growing context and generates
  `--agent-output-tokens` tokens. Three ways: Loom live sessions (`POST /v1/sessions`, then
  `POST /v1/sessions/{id}/append` with sampling fields each turn), the whole history re-sent
  to Loom's `/v1/completions` (its prefix cache finds what it can), and the whole history
  re-sent to llama.cpp's `/v1/completions` (it reuses the KV of the single previous prompt
  only). Per-turn latency (mean, p99, and by turn index) and total time.
- Agents beside a long-prompt client (Loom): the live-session agents again while another
  client keeps sending `--contention-tokens` prompts back to back (`--contention-clients`
  at once), the agents' appends at the same priority as its prompts ("session-contended")
  and at a lower value, so first ("session-priority"). What priority buys an agent whose
  tool result arrives behind someone's long prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common as c

NAME = "serving"
TITLE = "Online serving: Poisson arrivals and agent loops over HTTP (loom serve vs llama.cpp)"

TTFT_LIMIT_S = 1.0  # the rate at which llama.cpp's p99 TTFT passes this is the comparison point

# Common English words: prompts and tool results are random sequences of them (one token each
# with a leading space, mostly), so prompts have exact lengths and tokenise alike everywhere.
_WORDS_TEXT = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book
eye job word business issue side kind head house service friend father power hour game line
end member law car city community name president team minute idea kid body information back
parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education foot boy age policy
process music market sense nation plan college interest death experience effect use class
control care field development role effort rate heart drug show leader light voice wife
police mind price report decision son view relationship town road arm difference value
building action model season society tax director position player record paper space ground
form event official matter center couple site project activity star table need court oil
situation cost industry figure street image phone data picture practice piece land product
doctor wall patient worker news test movie north love support technology step baby computer
type attention film tree source organization hair window evidence population river
"""
_WORDS = _WORDS_TEXT.split()


# ---- servers ---------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """A server subprocess: started in its own session, its output in a log file, waited on
    until `ready_path` answers 200, stopped by its process id."""

    def __init__(self, name: str, cmd: list[str], port: int, ready_path: str,
                 settings: dict[str, Any]) -> None:
        self.name, self.cmd, self.port, self.ready_path = name, cmd, port, ready_path
        self.settings = settings
        self.url = f"http://127.0.0.1:{port}"
        fd, path = tempfile.mkstemp(prefix=f"bench-serving-{name.replace('.', '')}-",
                                    suffix=".log")
        os.close(fd)
        self.log_path = Path(path)
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    def start(self, timeout_s: float = 600.0) -> None:
        """Start the process and wait until it answers (raise with its log tail if it dies or
        does not answer in time)."""
        import httpx

        c.log(f"{self.name}: starting: {' '.join(self.cmd)} (log {self.log_path})")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(self.cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=c.ROOT, env=env,
                                         start_new_session=True)
        start = c.now()
        while c.now() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while "
                                   f"starting; log tail:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + self.ready_path, timeout=2.0).status_code == 200:
                    self.startup_s = round(c.now() - start, 1)
                    c.log(f"{self.name}: ready after {self.startup_s} s")
                    return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer {self.ready_path} within {timeout_s} s;"
                           f" log tail:\n{self.log_tail()}")

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGINT (a graceful shutdown), then SIGKILL after 20 s; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's output."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def log_problems(self, limit: int = 30) -> list[str]:
        """Lines of the server's log that look like errors (tracebacks, 5xx, warnings)."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        keys = ("Traceback", "Error", "error", "Exception", " 500 ", " 503 ", " 502 ",
                "WARNING", "Warning")
        return [line for line in text if any(k in line for k in keys)][:limit]


def loom_server(args: Any) -> Server:
    """`loom serve` on the benchmark's model with continuous batching."""
    port = free_port()
    settings = {"dtype": args.dtype, "device": args.device, "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "max_step_ms": args.max_step_ms,
                "quantization": args.quantization, "enable_prefix_caching": True}
    cmd = [sys.executable, "-m", "loom.cli", "serve", "--model", args.model, "--port", str(port),
           "--served-model-name", args.model, "--dtype", args.dtype, "--device", args.device,
           "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-step-ms", str(args.max_step_ms),
           "--max-sessions-per-key", str(max(64, args.agents * 2)),
           "--log-level", "warning"]
    cmd += ["--quantization", args.quantization]
    return Server("loom", cmd, port, "/health", settings)


def llama_cpp_available(args: Any) -> bool:
    """Whether llama-cpp-python's server can run here (a skip note says why not)."""
    if args.no_llama_cpp:
        c.skip("llama.cpp: skipped (--no-llama-cpp)")
        return False
    try:
        import llama_cpp
        import llama_cpp.server  # noqa: F401
    except ImportError as exc:
        c.skip(f"llama.cpp: skipped (llama-cpp-python's server not installed: {exc}; "
               "pip install 'llama-cpp-python[server]')")
        return False
    path = c.model_path(args.model)
    if not path.is_file() or path.suffix != ".gguf":
        c.skip(f"llama.cpp: skipped ({path} is not a GGUF file)")
        return False
    return True


def llama_cpp_server(args: Any, n_ctx: int, cache: bool = False) -> Server:
    """llama-cpp-python's OpenAI server on the same GGUF (`cache`: its RAM prompt cache)."""
    import llama_cpp

    port = free_port()
    # One sequence at a time: llama-cpp-python's server has no parallel slots (one `Llama`
    # behind a lock), so requests queue. Settings away from its defaults:
    # interrupt_requests=False (by default a new request cuts off the one streaming, which
    # would end requests early instead of queueing them); logits_all=False (its server
    # default True computes vocabulary logits for every prompt token, about 2x the prefill
    # time; only logprobs need them).
    settings = {"version": llama_cpp.__version__, "n_ctx": n_ctx, "n_threads": args.threads,
                "n_threads_batch": args.threads, "n_batch": 512, "n_ubatch": 512,
                "interrupt_requests": False, "logits_all": False, "cache": cache,
                "parallel_slots": 1,
                "sampling": "temperature 0, repeat_penalty 1.0 (its default 1.1 off)"}
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(c.model_path(args.model)),
           "--model_alias", args.model, "--host", "127.0.0.1", "--port", str(port),
           "--n_ctx", str(n_ctx), "--n_threads", str(args.threads),
           "--n_threads_batch", str(args.threads), "--n_batch", "512", "--n_ubatch", "512",
           "--interrupt_requests", "False", "--logits_all", "False", "--verbose", "False"]
    if cache:
        cmd += ["--cache", "True"]
    return Server("llama.cpp+cache" if cache else "llama.cpp", cmd, port, "/v1/models",
                  settings)


# ---- client ----------------------------------------------------------------------------


def completion_payload(server: str, model: str, prompt: str, out_tokens: int) -> dict:
    """A streamed greedy `/v1/completions` body that generates exactly `out_tokens`."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": out_tokens,
                            "min_tokens": out_tokens, "temperature": 0.0, "stream": True}
    if server == "loom":
        body.update(ignore_eos=True, stream_options={"include_usage": True})
    else:
        body.update(repeat_penalty=1.0)
    return body


async def response_request(client: Any, body: dict) -> dict:
    """POST a (non-streamed) response: its latency (as TTFT too), output and input tokens,
    the tokens it did not compute (`cached_tokens`) and its id."""
    rec: dict[str, Any] = {"ok": False, "error": None, "text": "", "output_tokens": 0,
                           "input_tokens": 0}
    start = c.now()
    try:
        resp = await client.post("/v1/responses", json=body)
    except Exception as exc:  # recorded, not raised
        rec["error"] = repr(exc)
        return rec
    rec["latency_s"] = rec["ttft_s"] = c.now() - start
    if resp.status_code != 200:
        rec["error"] = f"HTTP {resp.status_code}: {resp.text[:300]}"
        return rec
    data = resp.json()
    usage = data.get("usage") or {}
    rec.update(ok=True, id=data["id"], text=data.get("output_text", ""),
               output_tokens=usage.get("output_tokens", 0),
               input_tokens=usage.get("input_tokens", 0),
               cached_tokens=(usage.get("input_tokens_details") or {}).get("cached_tokens", 0))
    return rec


async def stream_request(client: Any, path: str, body: dict, appended: int = 0) -> dict:
    """POST `body`, read the SSE stream: start-relative chunk times, TTFT, latency, tokens.

    A chunk is an event with text; its arrival time is the time of its tokens. Output tokens
    are the server's `usage.completion_tokens` where it sends one (less `appended`, the
    fragment of a session append, if the server counted it), else the number of chunks with
    text.
    """
    rec: dict[str, Any] = {"ok": False, "error": None, "chunks": [], "text": "",
                           "output_tokens": 0, "usage": None}
    start = c.now()
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                rec["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:500]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    rec["error"] = f"error event: {event['error']}"
                    break
                if event.get("usage"):
                    rec["usage"] = event["usage"]
                if event.get("object") == "session.generation":  # a session's final event
                    continue
                if "choices" in event:
                    text = "".join(ch.get("text") or "" for ch in event["choices"])
                else:
                    text = event.get("text") or ""
                if text:
                    rec["chunks"].append(c.now() - start)
                    rec["text"] += text
    except Exception as exc:  # a failing request is recorded, not fatal
        rec["error"] = f"{type(exc).__name__}: {exc}"
        return rec
    rec["latency_s"] = c.now() - start
    if rec["error"] is None and rec["chunks"]:
        rec["ok"] = True
        rec["ttft_s"] = rec["chunks"][0]
        usage = rec["usage"]
        rec["output_tokens"] = usage["completion_tokens"] if usage else len(rec["chunks"])
        if appended and rec["output_tokens"] > body.get("max_tokens", rec["output_tokens"]):
            rec["output_tokens"] -= appended  # a server that counts the fragment echoes it
    elif rec["error"] is None:
        rec["error"] = "no tokens streamed"
    return rec


def pct(values: list[float], q: float, scale: float = 1e3) -> float | None:
    """The q-th percentile (numpy's linear interpolation, as vLLM) times `scale`, rounded."""
    import numpy as np

    return round(float(np.percentile(values, q)) * scale, 2) if values else None


def mean(values: list[float], scale: float = 1e3) -> float | None:
    """The mean times `scale`, rounded (None when empty)."""
    return round(sum(values) / len(values) * scale, 2) if values else None


def summarize(records: list[dict], duration: float) -> dict[str, Any]:
    """vLLM's serving metrics of one run."""
    ok = [r for r in records if r["ok"]]
    ttft = [r["ttft_s"] for r in ok]
    tpot = [(r["latency_s"] - r["ttft_s"]) / (r["output_tokens"] - 1)
            for r in ok if r["output_tokens"] > 1]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:], strict=False)]
    e2e = [r["latency_s"] for r in ok]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = [r["usage"]["prompt_tokens"] for r in ok if r["usage"]]
    errors = sorted({r["error"] for r in records if r["error"]})
    return {
        "completed": len(ok), "failed": len(records) - len(ok),
        "duration_s": round(duration, 2),
        "request_throughput": round(len(ok) / duration, 3),
        "output_tokens": out_tokens,
        "input_tokens_min_max": [min(in_tokens), max(in_tokens)] if in_tokens else None,
        "output_tokens_min_max": [min((r["output_tokens"] for r in ok), default=0),
                                  max((r["output_tokens"] for r in ok), default=0)],
        "output_tok_s": round(out_tokens / duration, 2),
        "ttft_ms_mean": mean(ttft), "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
        "tpot_ms_mean": mean(tpot), "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99),
        "itl_ms_mean": mean(itl), "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99),
        "e2e_ms_p50": pct(e2e, 50), "e2e_ms_p99": pct(e2e, 99),
        "errors": errors[:5],
    }


def new_client(server: Server) -> Any:
    """An async HTTP client for the server: no timeouts (queues can be long), no pool cap."""
    import httpx

    return httpx.AsyncClient(base_url=server.url, timeout=None,
                             limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=None))


# ---- prompts ---------------------------------------------------------------------------


class Words:
    """Random-word texts of exact token lengths under the model's tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.one_token = [w for w in _WORDS
                          if len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1]

    def text(self, num_tokens: int, seed: int, leading_space: bool = True) -> str:
        """`num_tokens` random words (one token each); as a prompt, BOS adds one more."""
        rng = random.Random(seed)
        words = [rng.choice(self.one_token) for _ in range(num_tokens)]
        text = " ".join(words)
        return (" " + text) if leading_space else text

    def count(self, text: str, special: bool = False) -> int:
        """Tokens of `text` (with BOS when `special`)."""
        return len(self.tok.encode(text, add_special_tokens=special))


# ---- workload 1: completions at request rates ------------------------------------------


def arrival_delays(num: int, rate: float, seed: int) -> list[float]:
    """Send times (s after the start) of `num` Poisson arrivals at `rate` req/s (inf: all
    at zero); the first at zero. The same seed gives the same times to every server."""
    rng, delays, t = random.Random(seed), [], 0.0
    for _ in range(num):
        delays.append(t)
        if rate != float("inf"):
            t += rng.expovariate(rate)
    return delays


def rate_seed(index: int) -> int:
    """The arrival seed of the index-th rate."""
    return 7 + index


async def run_rate(server: Server, model: str, prompts: list[str], out_tokens: int,
                   rate: float, seed: int) -> dict[str, Any]:
    """Send the prompts with Poisson arrivals at `rate` req/s (inf: all at once)."""
    async with new_client(server) as client:
        async def one(delay: float, prompt: str) -> dict:
            await asyncio.sleep(delay)
            body = completion_payload(server.name, model, prompt, out_tokens)
            return await stream_request(client, "/v1/completions", body)

        delays = arrival_delays(len(prompts), rate, seed)
        start = c.now()
        records = await asyncio.gather(*(one(d, p) for d, p in zip(delays, prompts,
                                                                    strict=True)))
        duration = c.now() - start
    row = summarize(list(records), duration)
    row["last_send_s"] = round(delays[-1], 2)
    return row


async def warmup(server: Server, model: str, words: Words, seed: int = 999) -> None:
    """Two short requests, so first-call costs stay out of the timings."""
    async with new_client(server) as client:
        for i in range(2):
            body = completion_payload(server.name, model, words.text(32, seed + i), 8)
            rec = await stream_request(client, "/v1/completions", body)
            if not rec["ok"]:
                raise RuntimeError(f"{server.name}: warmup request failed: {rec['error']}; "
                                   f"log tail:\n{server.log_tail()}")


def step_histogram(server: Server) -> dict[float, int] | None:
    """Loom's step-time histogram from `/metrics` (upper bound s -> steps at most that
    long, cumulative), or None (another server, or no such metric)."""
    import httpx

    if server.name != "loom":
        return None
    try:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    buckets: dict[float, int] = {}
    for line in text.splitlines():
        if line.startswith("loom:step_time_seconds_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float(bound)] = int(float(line.rsplit(" ", 1)[1]))
    return buckets or None


def steps_over(before: dict[float, int] | None, after: dict[float, int] | None,
               budget_ms: float) -> dict[str, Any] | None:
    """The steps of a workload (the histogram's difference) and the share of them longer
    than 1.5x the time budget (the bucket bound at or above it)."""
    if not before or not after or not budget_ms:
        return None
    bound = min(b for b in after if b * 1e3 >= 1.5 * budget_ms)
    total = after[float("inf")] - before.get(float("inf"), 0)
    within = after[bound] - before.get(bound, 0)
    return {"steps": total, "over_ms": round(bound * 1e3),
            "share_over": round((total - within) / total, 3) if total else None}


def completions_workload(server: Server, args: Any, words: Words) -> dict[str, Any]:
    """Every rate, one after another, on one server."""
    rows: dict[str, Any] = {}
    for i, rate in enumerate(args.rates):
        prompts = [words.text(args.input_tokens - 1, seed=10_000 * (i + 1) + j,
                              leading_space=False) for j in range(args.num_prompts)]
        before = step_histogram(server)
        row = asyncio.run(run_rate(server, args.model, prompts, args.output_tokens, rate,
                                   seed=rate_seed(i)))
        # The cost model's chunks against the budget: steps over 1.5x it (Loom only).
        row["step_times"] = steps_over(before, step_histogram(server), args.max_step_ms)
        row["rate"] = rate_name(rate)
        rows[rate_name(rate)] = row
        c.log(f"{server.name} rate {rate_name(rate)}: {compact(row)}")
        if not server.alive():
            raise RuntimeError(f"{server.name} died during rate {rate_name(rate)}; log tail:\n"
                               f"{server.log_tail()}")
    return rows


def rate_name(rate: float) -> str:
    """A rate as the table shows it."""
    return "inf" if rate == float("inf") else f"{rate:g}"


def compact(row: dict) -> str:
    """A one-line progress summary of a rate's row."""
    keys = ("completed", "failed", "duration_s", "output_tok_s", "ttft_ms_p50", "ttft_ms_p99",
            "tpot_ms_p50", "itl_ms_p99")
    steps = row.get("step_times") or {}
    return ", ".join(f"{k}={row[k]}" for k in keys) + (
        f", steps over {steps['over_ms']} ms: {steps['share_over']}" if steps else "")


# ---- workload 2: agents ----------------------------------------------------------------


async def long_prompts(server: Server, args: Any, words: Words, client: Any,
                       done: asyncio.Event, counts: dict[str, int]) -> None:
    """Another client's long prompts, back to back until `done` (priority 0)."""
    n = 0
    while not done.is_set():
        prompt = words.text(args.contention_tokens, seed=200_000 + n, leading_space=False)
        n += 1
        rec = await stream_request(client, "/v1/completions", completion_payload(
            server.name, args.model, prompt, 4))
        counts["ok" if rec["ok"] else "failed"] += 1


async def agent_loop(server: Server, args: Any, words: Words, mode: str) -> dict[str, Any]:
    """`args.agents` agents at once, `args.turns` turns each; `mode` is "session" (Loom's
    live sessions), "responses" (OpenAI's Responses API, each turn naming the previous
    response: Loom continues its session), "resend" (the whole history to
    `/v1/completions` every turn), or "session-contended" / "session-priority" (live
    sessions beside a client sending long prompts; the latter's appends with priority -1)."""
    contended = mode in ("session-contended", "session-priority")
    priority = -1 if mode == "session-priority" else 0
    if contended:
        mode = "session"
    out = args.agent_output_tokens
    turns: list[list[dict]] = [[] for _ in range(args.turns)]
    created: list[float] = []
    # Each mode its own texts: Loom's prefix cache must not find one mode's blocks in the
    # next (the re-sends on llama.cpp use the same texts as on Loom, in another process).
    base = {"session": 50_000, "resend": 70_000, "responses": 90_000}[mode] + (
        10_000 * (1 - priority) if contended else 0)

    async def agent(a: int, client: Any) -> None:
        history = words.text(args.agent_prompt_tokens - 1, seed=base + a, leading_space=False)
        sid = None
        previous: str | None = None  # the responses mode's last response
        if mode == "session":
            t0 = c.now()
            resp = await client.post("/v1/sessions", json={"prompt": history})
            if resp.status_code != 200:
                raise RuntimeError(f"POST /v1/sessions: HTTP {resp.status_code}: {resp.text}")
            sid = resp.json()["id"]
            created.append(c.now() - t0)
        try:
            for t in range(args.turns):
                tool = words.text(args.tool_tokens, seed=base + 1_000 + 100 * a + t)
                if mode == "session":
                    body = {"text": tool, "max_tokens": out, "min_tokens": out,
                            "ignore_eos": True, "temperature": 0.0, "stream": True,
                            "priority": priority}
                    rec = await stream_request(client, f"/v1/sessions/{sid}/append", body,
                                               appended=words.count(tool))
                elif mode == "responses":
                    text = history + tool if previous is None else tool
                    rec = await response_request(client, {
                        "model": args.model, "input": text, "max_output_tokens": out,
                        "temperature": 0.0, "previous_response_id": previous})
                    if previous is not None and rec["ok"]:  # only the last one is needed
                        await client.delete(f"/v1/responses/{previous}")
                    previous = rec.get("id")
                else:
                    history += tool
                    body = completion_payload(server.name, args.model, history, out)
                    rec = await stream_request(client, "/v1/completions", body)
                if not rec["ok"]:
                    raise RuntimeError(f"{server.name} {mode}: agent {a} turn {t}: "
                                       f"{rec['error']}")
                if mode == "resend":
                    history += rec["text"]
                # Context after the turn (BOS, prompt, tool results and generated tokens).
                rec["context_tokens"] = (
                    words.count(history, special=True) if mode == "resend" else
                    rec["input_tokens"] + rec["output_tokens"] if mode == "responses" else
                    args.agent_prompt_tokens + (t + 1) * (args.tool_tokens + out))
                turns[t].append(rec)
        finally:
            if sid is not None:
                await client.delete(f"/v1/sessions/{sid}")
            if previous is not None:
                await client.delete(f"/v1/responses/{previous}")

    counts = {"ok": 0, "failed": 0}
    async with new_client(server) as client:
        done = asyncio.Event()
        others = [asyncio.ensure_future(long_prompts(server, args, words, client, done, counts))
                  for _ in range(args.contention_clients if contended else 0)]
        if others:
            await asyncio.sleep(0.5)  # the long prompts are under way when agents start
        start = c.now()
        try:
            await asyncio.gather(*(agent(a, client) for a in range(args.agents)))
        finally:
            done.set()
            await asyncio.gather(*others, return_exceptions=True)
        total = c.now() - start
    flat = [r for turn in turns for r in turn]
    lat = [r["latency_s"] for r in flat]
    by_turn = [{"turn": t, "latency_ms_mean": mean([r["latency_s"] for r in recs]),
                "ttft_ms_mean": mean([r["ttft_s"] for r in recs]),
                "output_tokens": [r["output_tokens"] for r in recs],
                "context_tokens": max((r["context_tokens"] or 0) for r in recs) or None}
               for t, recs in enumerate(turns)]
    first, last = by_turn[0]["latency_ms_mean"], by_turn[-1]["latency_ms_mean"]
    return {"total_s": round(total, 2), "turns": len(flat),
            "turn_latency_ms_mean": mean(lat), "turn_latency_ms_p50": pct(lat, 50),
            "turn_latency_ms_p99": pct(lat, 99),
            "turn_ttft_ms_mean": mean([r["ttft_s"] for r in flat]),
            "turn_ttft_ms_p99": pct([r["ttft_s"] for r in flat], 99),
            "first_turn_ms": first, "last_turn_ms": last,
            "last_over_first_turn": c.ratio(last, first),
            "session_create_ms_mean": mean(created) if created else None,
            "cached_input_share": round(sum(r.get("cached_tokens", 0) for r in flat)
                                        / max(sum(r.get("input_tokens", 0) for r in flat), 1),
                                        3) if mode == "responses" else None,
            "output_tok_s": round(sum(r["output_tokens"] for r in flat) / total, 2),
            "long_prompts_completed": counts["ok"] if contended else None,
            "by_turn": by_turn}


def agents_workload(server: Server, args: Any, words: Words, mode: str) -> dict[str, Any]:
    """One agent workload on one server (progress logged)."""
    row = asyncio.run(agent_loop(server, args, words, mode))
    c.log(f"{server.name} agents ({mode}): total {row['total_s']} s, turn mean "
          f"{row['turn_latency_ms_mean']} ms, p99 {row['turn_latency_ms_p99']} ms, first/last "
          f"turn {row['first_turn_ms']}/{row['last_turn_ms']} ms")
    return row


# ---- running a server ------------------------------------------------------------------


def run_server(server: Server, args: Any, words: Words, agent_modes: list[str],
               completions: bool = True) -> dict[str, Any]:
    """Start the server, run the workloads on it, stop it; errors are recorded."""
    out: dict[str, Any] = {"settings": server.settings, "command": " ".join(server.cmd),
                           "log": str(server.log_path), "completions": {}, "agents": {}}
    try:
        server.start()
        out["startup_s"] = server.startup_s
        asyncio.run(warmup(server, args.model, words))
        if completions:
            out["completions"] = completions_workload(server, args, words)
        for mode in agent_modes:
            out["agents"][mode] = agents_workload(server, args, words, mode)
    except Exception as exc:  # recorded with the server's log, so the rest still reports
        c.skip(f"{server.name}: failed: {exc}")
        out["error"] = str(exc)
    finally:
        alive = server.alive()
        code = server.stop()
        out["exit_code"] = code
        out["alive_at_end"] = alive
        problems = server.log_problems()
        if problems:
            out["log_problems"] = problems
        if not alive or out.get("error"):
            out["log_tail"] = server.log_tail()
    return out


# ---- ratios ----------------------------------------------------------------------------


def compare(results: dict[str, Any], rates: list[str]) -> dict[str, Any]:
    """Loom against llama.cpp: where llama.cpp's p99 TTFT passes 1 s, Loom's p99 TTFT and
    output throughput there and at the highest rate; the agent ratios."""
    loom = results.get("loom", {}).get("completions", {})
    llama = (results.get("llama.cpp") or {}).get("completions", {})
    s: dict[str, Any] = {"ttft_limit_s": TTFT_LIMIT_S}
    if not llama:
        s["note"] = ("llama.cpp did not run (see skip notes): no Loom/llama.cpp ratios")
    else:
        cross = next((r for r in rates if r in llama and r in loom
                      and (llama[r]["ttft_ms_p99"] or 0) > TTFT_LIMIT_S * 1e3), None)
        s["rate_llama_cpp_p99_ttft_passes_1s"] = cross
        if cross is None:
            s["note"] = f"llama.cpp's p99 TTFT stayed under {TTFT_LIMIT_S} s at every rate"
        else:
            s["loom_p99_ttft_ms_there"] = loom[cross]["ttft_ms_p99"]
            s["llama_cpp_p99_ttft_ms_there"] = llama[cross]["ttft_ms_p99"]
            s["p99_ttft_loom_over_llama_cpp"] = c.ratio(loom[cross]["ttft_ms_p99"],
                                                        llama[cross]["ttft_ms_p99"])
            s["output_tok_s_loom_over_llama_cpp_there"] = c.ratio(
                loom[cross]["output_tok_s"], llama[cross]["output_tok_s"])
        top = rates[-1]
        if top in loom and top in llama:
            s["sustained_rate"] = top
            s["sustained_output_tok_s_loom"] = loom[top]["output_tok_s"]
            s["sustained_output_tok_s_llama_cpp"] = llama[top]["output_tok_s"]
            s["sustained_output_tok_s_loom_over_llama_cpp"] = c.ratio(
                loom[top]["output_tok_s"], llama[top]["output_tok_s"])
        s["p99_ttft_loom_over_llama_cpp_by_rate"] = {
            r: c.ratio(loom[r]["ttft_ms_p99"], llama[r]["ttft_ms_p99"])
            for r in rates if r in loom and r in llama}
        s["output_tok_s_loom_over_llama_cpp_by_rate"] = {
            r: c.ratio(loom[r]["output_tok_s"], llama[r]["output_tok_s"])
            for r in rates if r in loom and r in llama}
    agents = {f"{srv} {mode}": row for srv, res in results.items() if res
              for mode, row in res.get("agents", {}).items()}
    base = agents.get("loom session")
    if base:
        for other in agents:
            if other != "loom session":
                key = other.replace(" ", "_").replace(".", "_").replace("+", "_")
                s[f"agents_total_{key}_over_session"] = c.ratio(agents[other]["total_s"],
                                                                base["total_s"])
                s[f"agents_turn_mean_{key}_over_session"] = c.ratio(
                    agents[other]["turn_latency_ms_mean"], base["turn_latency_ms_mean"])
                s[f"agents_last_turn_{key}_over_session"] = c.ratio(
                    agents[other]["last_turn_ms"], base["last_turn_ms"])
    return s


# ---- main ------------------------------------------------------------------------------


def parse_rates(text: str) -> list[float]:
    """"0.25,0.5,inf" as floats (inf last, whatever the order given)."""
    rates = sorted(float(r) for r in text.split(","))
    return rates


def main() -> None:
    """Parse arguments, run each server in turn, report."""
    parser = c.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rates", default=None,
                        help="request rates, req/s, comma-separated; inf: all at once "
                             "(default 0.25,0.5,1,2,inf; quick 2,inf)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="requests per rate (default 12, quick 8)")
    parser.add_argument("--input-tokens", type=int, default=None,
                        help="prompt tokens, BOS included (default 128, quick 64)")
    parser.add_argument("--output-tokens", type=int, default=None,
                        help="generated tokens per request (default 64, quick 16)")
    parser.add_argument("--agents", type=int, default=None, help="default 4 (quick 2)")
    parser.add_argument("--turns", type=int, default=None, help="default 6 (quick 3)")
    parser.add_argument("--agent-prompt-tokens", type=int, default=None,
                        help="each agent's first prompt (default 128, quick 64)")
    parser.add_argument("--tool-tokens", type=int, default=None,
                        help="tool result appended per turn (default 64, quick 32)")
    parser.add_argument("--agent-output-tokens", type=int, default=None,
                        help="tokens generated per turn (default 32, quick 16)")
    parser.add_argument("--contention-tokens", type=int, default=1024,
                        help="the long-prompt client's prompt length (contended agent modes)")
    parser.add_argument("--contention-clients", type=int, default=2,
                        help="long prompts in flight at once beside the contended agents")
    parser.add_argument("--agent-modes", default="session,responses,resend,"
                        "session-contended,session-priority",
                        help="Loom's agent workloads, comma-separated")
    parser.add_argument("--no-completions", action="store_true",
                        help="agents only (skip the Poisson completions workload)")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="loom serve")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="loom serve")
    parser.add_argument("--max-step-ms", type=float, default=100.0,
                        help="loom serve's time budget per step (0: off, tokens alone)")
    parser.add_argument("--llama-cpp-cache", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="also run the agents on a llama.cpp server with its RAM prompt "
                             "cache (--cache True; off by default there) (default on, quick "
                             "off)")
    args = parser.parse_args()
    if args.doc_only:
        return c.rerender(NAME, TITLE, render)
    q = args.quick
    args.rates = parse_rates(args.rates or ("2,inf" if q else "0.25,0.5,1,2,inf"))
    args.num_prompts = args.num_prompts or (8 if q else 12)
    args.input_tokens = args.input_tokens or (64 if q else 128)
    args.output_tokens = args.output_tokens or (16 if q else 64)
    args.agents = args.agents or (2 if q else 4)
    args.turns = args.turns or (3 if q else 6)
    args.agent_prompt_tokens = args.agent_prompt_tokens or (64 if q else 128)
    args.tool_tokens = args.tool_tokens or (32 if q else 64)
    args.agent_output_tokens = args.agent_output_tokens or (16 if q else 32)
    if args.llama_cpp_cache is None:
        args.llama_cpp_cache = not q
    if args.dtype != "auto":
        c.log("note: --dtype is passed to loom serve; llama.cpp runs the GGUF's own types")

    from loom.tokenizer.loader import load_tokenizer

    words = Words(load_tokenizer(c.model_path(args.model)))
    agent_ctx = args.agent_prompt_tokens + args.turns * (args.tool_tokens
                                                         + args.agent_output_tokens + 8)
    n_ctx = max(2048, 256 * ((max(agent_ctx, args.input_tokens + args.output_tokens) + 511)
                             // 256))

    # A terminated benchmark still stops its servers (the `finally` in run_server).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_start = os.getloadavg()
    results: dict[str, Any] = {}
    started = c.now()
    results["loom"] = run_server(loom_server(args), args, words, args.agent_modes.split(","),
                                 completions=not args.no_completions)
    if llama_cpp_available(args):
        results["llama.cpp"] = run_server(llama_cpp_server(args, n_ctx), args, words,
                                          ["resend"], completions=not args.no_completions)
        if args.llama_cpp_cache:
            results["llama.cpp+cache"] = run_server(llama_cpp_server(args, n_ctx, cache=True),
                                                    args, words, ["resend"],
                                                    completions=False)
    else:
        results["llama.cpp"] = None
    c.log(f"all runs took {c.now() - started:.0f} s")

    rates = [rate_name(r) for r in args.rates]
    summary = compare(results, rates)
    c.log(f"summary: {json.dumps(summary)}")
    sizes = (f"completions: {args.num_prompts} requests per rate at {', '.join(rates)} req/s "
             f"(Poisson), {args.input_tokens}-token prompts, {args.output_tokens} output tokens; "
             f"agents: {args.agents} x {args.turns} turns, {args.agent_prompt_tokens}-token "
             f"first prompt, {args.tool_tokens}-token tool result and "
             f"{args.agent_output_tokens} generated tokens per turn")
    config = {k: (v if not isinstance(v, float) or v != float("inf") else "inf")
              for k, v in vars(args).items() if k not in ("doc_only",)}
    config["rates"] = rates
    config["llama_cpp_n_ctx"] = n_ctx
    # The host is shared: load averages (1, 5, 15 min) before and after tell a noisy run.
    config["loadavg_start"] = [round(x, 2) for x in load_start]
    config["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    config["wall_s"] = round(c.now() - started, 1)
    config["client"] = "asyncio + httpx, streaming (SSE), on the same machine as the server"
    result = c.header(NAME, args, dtype=args.dtype, quantization=args.quantization,
                      sizes_note=sizes, config=config, results=results, summary=summary,
                      skipped=[] if results["llama.cpp"] else ["llama.cpp"])
    c.finish(NAME, TITLE, result, render, args.no_doc)


# ---- the doc section -------------------------------------------------------------------


def render(result: dict[str, Any]) -> str:
    """The doc section: the completions table, the agent table, the ratios."""
    res, s = result["results"], result["summary"]
    rows = []
    for srv, r in res.items():
        if not r:
            continue
        for i, (rate, x) in enumerate(r.get("completions", {}).items()):
            n = x["completed"] + x["failed"]
            last = arrival_delays(n, float(rate), rate_seed(i))[-1]
            sent = "all at 0" if rate == "inf" else f"{(n - 1) / last:.2f}" if last else "—"
            rows.append([srv, rate, sent, f"{x['completed']}/{n}",
                         x["duration_s"], x["request_throughput"], x["output_tok_s"],
                         x["ttft_ms_p50"], x["ttft_ms_p99"], x["tpot_ms_p50"], x["tpot_ms_p99"],
                         x["itl_ms_p50"], x["itl_ms_p99"]])
    table1 = c.markdown_table(
        ["server", "rate req/s", "sent at req/s", "completed", "duration s", "req/s",
         "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "ITL p50 ms",
         "ITL p99 ms"], rows)
    arows = []
    for srv, r in res.items():
        if not r:
            continue
        for mode, x in r.get("agents", {}).items():
            label = {"session": "live session (append)",
                     "responses": "Responses API (previous_response_id)",
                     "resend": "re-send history (/v1/completions)",
                     "session-contended": "live session beside long prompts, same priority",
                     "session-priority": "live session beside long prompts, priority -1",
                     }[mode]
            arows.append([srv, label, x["total_s"], x["turn_latency_ms_mean"],
                          x["turn_latency_ms_p99"], x["turn_ttft_ms_mean"], x["first_turn_ms"],
                          x["last_turn_ms"], x["last_over_first_turn"], x["output_tok_s"]])
    table2 = c.markdown_table(
        ["server", "agent loop", "total s", "turn mean ms", "turn p99 ms", "turn TTFT mean ms",
         "first turn ms", "last turn ms", "last/first", "output tok/s"], arows)
    cfg = result.get("config", {})
    loom = res.get("loom") or {}
    llama = res.get("llama.cpp") or {}
    settings = (f"Loom: `loom serve` {json.dumps(loom.get('settings', {}))}"
                + (f"; llama.cpp: `python -m llama_cpp.server` "
                   f"{json.dumps(llama.get('settings', {}))}" if llama else "")
                + ("; llama.cpp+cache: the same with `--cache True` (its RAM prompt cache: "
                   "the state after each request is saved and the longest matching prefix "
                   "restored), agents only" if res.get("llama.cpp+cache") else "")
                + ". Client: asyncio + httpx streaming over SSE on the same machine.")
    text = [f"Completions at Poisson request rates ({cfg.get('num_prompts')} requests per "
            f"rate, the same prompts and send times on both servers; `sent at` is the rate "
            f"the seeded Poisson draw actually sent at, (n - 1) / last send time; TPOT "
            f"excludes the first token; ITL is the gap between streamed chunks):\n\n{table1}",
            f"Agents: {cfg.get('agents')} concurrent agents x {cfg.get('turns')} turns, each "
            f"turn appends a {cfg.get('tool_tokens')}-token tool result and generates "
            f"{cfg.get('agent_output_tokens')} tokens; a turn's latency runs from sending it "
            f"to its last token:\n\n{table2}", settings]
    if s.get("note"):
        text.append(f"**{s['note']}.**")
    if s.get("rate_llama_cpp_p99_ttft_passes_1s"):
        text.append(
            f"llama.cpp's p99 TTFT passes {s['ttft_limit_s']:g} s at "
            f"{s['rate_llama_cpp_p99_ttft_passes_1s']} req/s "
            f"({c.fmt(s['llama_cpp_p99_ttft_ms_there'])} ms); Loom's p99 TTFT there is "
            f"{c.fmt(s['loom_p99_ttft_ms_there'])} ms, "
            f"{c.fmt(s['p99_ttft_loom_over_llama_cpp'])}x llama.cpp's (target at most 0.5x), "
            f"with {c.fmt(s['output_tok_s_loom_over_llama_cpp_there'])}x its output tok/s"
            + (" (already at the lowest rate measured: a lower `--rates` value finds where "
               "llama.cpp stays under it)" if s["rate_llama_cpp_p99_ttft_passes_1s"]
               == (cfg.get("rates") or [None])[0] else "") + ".")
    if s.get("sustained_rate"):
        text.append(
            f"Sustained output at rate {s['sustained_rate']}: Loom "
            f"{c.fmt(s['sustained_output_tok_s_loom'])} tok/s vs llama.cpp "
            f"{c.fmt(s['sustained_output_tok_s_llama_cpp'])} tok/s, "
            f"{c.fmt(s['sustained_output_tok_s_loom_over_llama_cpp'])}x (target at least 2x).")
    agent_bits = []
    for key, label in (("loom_session-contended", "An agent beside long prompts"),
                       ("loom_session-priority", "With priority -1, an agent beside long "
                                                 "prompts"),
                       ("loom_responses", "Loom's Responses API"),
                       ("loom_resend", "re-sending to Loom"),
                       ("llama_cpp_resend", "re-sending to llama.cpp"),
                       ("llama_cpp_cache_resend", "re-sending to llama.cpp with its prompt "
                                                  "cache")):
        if s.get(f"agents_total_{key}_over_session") is not None:
            agent_bits.append(
                f"{label} takes {c.fmt(s[f'agents_total_{key}_over_session'])}x the total "
                f"time of Loom's live sessions ({c.fmt(s[f'agents_turn_mean_{key}_over_session'])}x"
                f" mean turn, {c.fmt(s[f'agents_last_turn_{key}_over_session'])}x last turn)")
    if agent_bits:
        text.append("Agents: " + "; ".join(agent_bits) + ".")
    return "\n\n".join(text) + c.skip_notes_md(result)


if __name__ == "__main__":
    main()
