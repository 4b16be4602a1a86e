"""`ServerMetrics`: engine gauges at scrape time, request metrics, optional groups, isolation."""

from __future__ import annotations

import threading

import pytest
from engine.helpers import make_engine, prompt_ids, run_to_completion, settle_session
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from loom import SamplingParams
from loom.engine.hooks import HookContext, SequenceHook
from loom.kv_connector import KVTransferConfig
from loom.server.metrics import ServerMetrics, token_buckets

MODEL = "tiny"
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PREFIX_CACHE = ["vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                "vllm:gpu_prefix_cache_hit_rate", "vllm:gpu_prefix_cache_queries",
                "vllm:gpu_prefix_cache_hits"]
SPEC = ["vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
        "loom:spec_decode_acceptance_rate"]
CONNECTOR = ["loom:kv_connector_loaded_tokens", "loom:kv_connector_gap_tokens",
             "loom:kv_connector_load_failed_tokens", "loom:kv_connector_saved_blocks"]


def scrape(metrics: ServerMetrics) -> dict[str, dict[tuple, float]]:
    """Render and parse: family name -> {(sample name, sorted labels): value}."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    families = {}
    for family in text_string_to_metric_families(body.decode()):
        families[family.name] = {
            (s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples
        }
    return families


def value(families, family: str, sample: str | None = None, **labels) -> float:
    """One sample's value (labels besides vLLM's model_name and engine given as keywords)."""
    key = (sample or family,
           tuple(sorted({"model_name": MODEL, "engine": "0", **labels}.items())))
    return families[family][key]


class BlockOnFirstToken(SequenceHook):
    """Blocks the sequence `seq_id` after its first token (nothing unblocks it)."""

    def __init__(self, seq_id: str) -> None:
        self.seq_id = seq_id

    def on_token(self, ctx: HookContext, seq_id: str, token_id: int) -> None:
        if seq_id == self.seq_id and not ctx.is_blocked(seq_id):
            ctx.block(seq_id)


def test_gauges_read_the_engine_at_scrape_time(tiny_models):
    folder, _ = tiny_models["llama"]
    engine = make_engine(folder, num_kv_blocks=64, max_num_seqs=2,
                         hooks=[BlockOnFirstToken("blocked")])
    metrics = ServerMetrics(engine, MODEL)
    m = scrape(metrics)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "loom:num_requests_paused", "loom:num_requests_blocked"):
        assert value(m, name) == 0
    assert value(m, "loom:num_kv_blocks_total") == 64
    assert value(m, "loom:num_kv_blocks_used") == 0
    assert value(m, "vllm:kv_cache_usage_perc") == 0.0

    engine.add_request("paused", prompt_ids(9), session=True)  # prefill only, then pauses
    engine.add_request("blocked", prompt_ids(7, 1), PARAMS)
    run_to_completion(engine)  # stops when nothing waits or runs: both are idle
    m = scrape(metrics)
    assert value(m, "vllm:num_requests_running") == value(m, "vllm:num_requests_waiting") == 0
    assert value(m, "loom:num_requests_paused") == 1
    assert value(m, "loom:num_requests_blocked") == 1
    used = 64 - engine.num_free_blocks
    assert used > 0
    assert value(m, "loom:num_kv_blocks_used") == used
    assert value(m, "vllm:kv_cache_usage_perc") == pytest.approx(engine.stats.kv_cache_usage)

    for i in range(4):
        engine.add_request(f"r{i}", prompt_ids(6, 10 + i), PARAMS)
    engine.step()
    m = scrape(metrics)
    assert value(m, "vllm:num_requests_running") == len(engine.scheduler.running) == 2
    assert value(m, "vllm:num_requests_waiting") == len(engine.scheduler.waiting) == 2
    assert value(m, "loom:num_queued_prompt_tokens") == 2 * 6  # the two waiting prompts
    assert value(m, "loom:step_time_seconds", "loom:step_time_seconds_count") == engine.num_steps
    assert value(m, "loom:num_kv_blocks_used") == 64 - engine.num_free_blocks
    assert value(m, "loom:num_engine_steps", "loom:num_engine_steps_total") == engine.num_steps
    assert value(m, "vllm:num_preemptions", "vllm:num_preemptions_total") == (
        engine.stats.num_preemptions
    )

    run_to_completion(engine)
    engine.abort_request("blocked")
    engine.close("paused")
    m = scrape(metrics)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "loom:num_requests_paused", "loom:num_requests_blocked"):
        assert value(m, name) == 0
    assert value(m, "loom:num_kv_blocks_used") == 0
    assert engine.kv_pool_all_free


def test_request_metrics_counted_at_the_engine(tiny_models):
    """Tokens, finished requests and per-request sizes come from the engine's own outputs:
    no route feeds them (an engine stepped directly is counted)."""
    folder, _ = tiny_models["qwen2"]
    engine = make_engine(folder)
    metrics = ServerMetrics(engine, MODEL)
    prompts = {f"r{i}": prompt_ids(5 + 3 * i, i) for i in range(3)}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, PARAMS)
    engine.add_request("gone", prompt_ids(4, 9), PARAMS)
    engine.abort_request("gone")  # before its first token: one abort, no tokens
    run_to_completion(engine)

    m = scrape(metrics)
    prompt_total = sum(len(ids) for ids in prompts.values())
    assert value(m, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == prompt_total
    assert value(m, "vllm:generation_tokens", "vllm:generation_tokens_total") == 3 * 5
    success = "vllm:request_success"
    assert value(m, success, success + "_total", finished_reason="length") == 3
    assert value(m, success, success + "_total", finished_reason="abort") == 1
    assert value(m, success, success + "_total", finished_reason="stop") == 0  # from start
    assert value(m, success, success + "_total", finished_reason="error") == 0

    def count(name: str) -> float:
        return value(m, name, name + "_count")

    assert count("vllm:inter_token_latency_seconds") == 3 * 4  # once per later token's step
    assert count("vllm:request_time_per_output_token_seconds") == 3
    assert count("vllm:request_decode_time_seconds") == 3
    assert count("vllm:request_prompt_tokens") == 3
    gen = "vllm:request_generation_tokens"
    assert value(m, gen, gen + "_sum") == 15
    assert value(m, gen, gen + "_bucket", le="5.0") == 3
    assert value(m, gen, gen + "_bucket", le="2.0") == 0
    # The engine stamps when it accepted each request: TTFT and end-to-end need no route
    # (the request aborted before its first token has neither).
    assert count("vllm:time_to_first_token_seconds") == 3
    assert count("vllm:e2e_request_latency_seconds") == 3


def test_latencies_with_a_fake_clock(tiny_models):
    """TTFT and end-to-end run from when the engine accepted a request (or began a session's
    segment) on the engine's clock; a session's segment ends with its last token."""
    folder, _ = tiny_models["llama"]
    now = [10.0]
    engine = make_engine(folder)
    engine.table.clock = lambda: now[0]
    metrics = ServerMetrics(engine, MODEL)
    engine.add_request("r", prompt_ids(6), PARAMS)  # accepted at 10
    now[0] = 11.0
    while engine.has_unfinished_requests():  # 5 tokens, one a second from 11: ends at 15
        engine.step()
        now[0] += 1.0

    m = scrape(metrics)
    ttft, e2e = "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"
    assert value(m, ttft, ttft + "_count") == 1
    assert value(m, ttft, ttft + "_sum") == pytest.approx(1.0)
    assert value(m, ttft, ttft + "_bucket", le="1.0") == 1
    assert value(m, ttft, ttft + "_bucket", le="0.75") == 0
    assert value(m, e2e, e2e + "_count") == 1
    assert value(m, e2e, e2e + "_sum") == pytest.approx(5.0)
    itl, tpot = "vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds"
    assert value(m, itl, itl + "_count") == 4
    assert value(m, itl, itl + "_sum") == pytest.approx(4.0)
    assert value(m, itl, itl + "_bucket", le="0.75") == 0
    assert value(m, itl, itl + "_bucket", le="1.0") == 4
    assert value(m, tpot, tpot + "_sum") == pytest.approx(1.0)
    decode = "vllm:request_decode_time_seconds"
    assert value(m, decode, decode + "_sum") == pytest.approx(4.0)
    assert value(m, "vllm:generation_tokens", "vllm:generation_tokens_total") == 5
    success = "vllm:request_success"
    assert value(m, success, success + "_total", finished_reason="length") == 1
    assert value(m, success, success + "_total", finished_reason="stop") == 0

    # A session: opening it (prefill only) is no segment; an append that starts one at 100
    # computes its fragment and samples at 102; 3 tokens, the last at 104, then it parks.
    engine.add_request("s", prompt_ids(8), session=True)
    settle_session(engine, "s")
    now[0] = 100.0
    engine.append("s", prompt_ids(2, 5), SamplingParams(temperature=0.0, max_tokens=3,
                                                        ignore_eos=True))
    now[0] = 102.0
    while engine.get_session("s").status != "PAUSED":
        engine.step()
        now[0] += 1.0  # the park's step (after the last token) is not part of the segment
    m = scrape(metrics)
    assert value(m, ttft, ttft + "_count") == 2
    assert value(m, ttft, ttft + "_sum") == pytest.approx(1.0 + 2.0)
    assert value(m, e2e, e2e + "_count") == 2
    assert value(m, e2e, e2e + "_sum") == pytest.approx(5.0 + 4.0)
    engine.close("s")
    assert engine.kv_pool_all_free


def test_sessions_and_their_segments_are_counted(tiny_models):
    """A session's segments are requests of their own: each counts its tokens, its context
    as prompt, and its reason; a segment under way when the session closes is an abort;
    a resume before the session parked still ends the segment before it."""
    folder, _ = tiny_models["llama"]
    engine = make_engine(folder)
    metrics = ServerMetrics(engine, MODEL)
    engine.add_request("s", prompt_ids(8), session=True)  # prefill only: nothing generated
    settle_session(engine, "s")
    engine.resume("s", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    settle_session(engine, "s")  # 3 tokens, then parks
    engine.append("s", prompt_ids(2, 5), SamplingParams(temperature=0.0, max_tokens=4,
                                                        ignore_eos=True))
    while engine.get_session("s").generating:
        engine.step()
    # The segment ended; resumed before the step that parks the session.
    assert engine.get_session("s").status != "PAUSED"
    engine.resume("s", SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()
    third = len(engine.get_session("s").token_ids) - (8 + 3 + 2 + 4)
    assert third >= 1
    engine.close("s")  # mid-segment: an abort

    m = scrape(metrics)
    success = "vllm:request_success"
    assert value(m, success, success + "_total", finished_reason="length") == 2
    assert value(m, success, success + "_total", finished_reason="abort") == 1
    assert value(m, "vllm:generation_tokens", "vllm:generation_tokens_total") == 3 + 4 + third
    gen = "vllm:request_generation_tokens"
    assert value(m, gen, gen + "_count") == 3
    assert value(m, gen, gen + "_sum") == 3 + 4 + third
    # Each segment's prompt is the session's context before its first token.
    assert value(m, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == (
        8 + (8 + 3 + 2) + (8 + 3 + 2 + 4))
    assert engine.kv_pool_all_free


@pytest.mark.parametrize("enabled", [False, True])
def test_prefix_cache_metrics_only_when_enabled(tiny_models, enabled):
    folder, _ = tiny_models["gemma3"]
    engine = make_engine(folder, enable_prefix_caching=enabled)
    metrics = ServerMetrics(engine, MODEL)
    shared = prompt_ids(24)
    for i in range(2):
        engine.add_request(f"r{i}", shared + prompt_ids(3, 50 + i), PARAMS)
        run_to_completion(engine)
    m = scrape(metrics)
    if not enabled:
        assert not set(PREFIX_CACHE) & set(m)
        return
    stats = engine.stats
    assert stats.prefix_cache_hits > 0
    assert value(m, PREFIX_CACHE[0], PREFIX_CACHE[0] + "_total") == stats.prefix_cache_queries
    assert value(m, PREFIX_CACHE[1], PREFIX_CACHE[1] + "_total") == stats.prefix_cache_hits
    assert value(m, PREFIX_CACHE[2]) == pytest.approx(stats.prefix_cache_hit_rate)
    assert m[PREFIX_CACHE[0]]  # typed as a counter by the parser (name without "_total")


def test_spec_decode_and_connector_metrics_only_when_configured(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    plain = scrape(ServerMetrics(make_engine(folder), MODEL))
    assert not set(SPEC + CONNECTOR) & set(plain)
    assert "vllm:num_requests_running" in plain

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    engine = make_engine(folder, speculative_config=spec)
    metrics = ServerMetrics(engine, MODEL)
    long = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine.add_request("r", [prompt_ids(4)[i % 4] for i in range(24)], long)
    run_to_completion(engine)
    m = scrape(metrics)
    assert not set(CONNECTOR) & set(m)
    stats = engine.stats
    assert stats.num_draft_tokens > 0
    assert value(m, SPEC[0], SPEC[0] + "_total") == stats.num_draft_tokens
    assert value(m, SPEC[1], SPEC[1] + "_total") == stats.num_accepted_draft_tokens
    rate = stats.num_accepted_draft_tokens / stats.num_draft_tokens if stats.num_draft_tokens \
        else 0.0
    assert value(m, SPEC[2]) == pytest.approx(rate)

    config = KVTransferConfig("SharedStorageConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    engine = make_engine(folder, kv_transfer_config=config)
    metrics = ServerMetrics(engine, MODEL)
    engine.add_request("r", prompt_ids(21), PARAMS)
    run_to_completion(engine)
    m = scrape(metrics)
    assert not set(SPEC) & set(m)
    saved = engine.stats.kv_saved_blocks
    assert saved > 0
    assert value(m, CONNECTOR[3], CONNECTOR[3] + "_total") == saved
    assert value(m, CONNECTOR[0], CONNECTOR[0] + "_total") == engine.stats.kv_loaded_tokens


def test_two_servers_in_one_process_do_not_collide(tiny_models):
    folder, _ = tiny_models["llama"]
    engine = make_engine(folder)
    first = ServerMetrics(engine, MODEL)
    engine.add_request("r", prompt_ids(6), PARAMS)
    run_to_completion(engine)
    second = ServerMetrics(engine, MODEL)  # same names, same labels: separate registries
    e2e = "vllm:e2e_request_latency_seconds"
    assert value(scrape(first), e2e, e2e + "_count") == 1
    assert value(scrape(second), e2e, e2e + "_count") == 0
    assert not any(m.name.startswith(("loom:", "vllm:")) for m in REGISTRY.collect())
    # A server's observer leaves the engine with it (an engine outlives its servers).
    hooks = len(engine.hooks)
    second.close()
    assert len(engine.hooks) == hooks - 1
    del first
    import gc
    gc.collect()
    assert len(engine.hooks) == hooks - 2


def test_token_buckets():
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_buckets(4096)[-1] == 2000
    assert token_buckets(0) == [1]


def test_scrapes_while_a_thread_steps_the_engine(tiny_models):
    folder, _ = tiny_models["qwen3"]
    engine = make_engine(folder, num_kv_blocks=32, max_num_seqs=3)
    metrics = ServerMetrics(engine, MODEL)
    for i in range(8):
        engine.add_request(f"r{i}", prompt_ids(10, i), PARAMS, session=i % 2 == 0)
    done = threading.Event()

    def stepper() -> None:
        try:
            run_to_completion(engine)
        finally:
            done.set()

    thread = threading.Thread(target=stepper)
    thread.start()
    scrapes = 0
    while not done.is_set() or scrapes == 0:
        m = scrape(metrics)
        assert 0.0 <= value(m, "vllm:kv_cache_usage_perc") <= 1.0
        scrapes += 1
    thread.join()
    m = scrape(metrics)
    assert value(m, "loom:num_requests_paused") == 4
    assert value(m, "loom:num_kv_blocks_used") == 32 - engine.num_free_blocks
