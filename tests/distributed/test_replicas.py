"""Engine replicas on Ray Serve (one Ray instance for the module, the tiny Gemma 3 model):
a session's calls stay on its replica and a new request follows its prefix; a session whose
replica is killed continues on another from the shared folder store, with the tokens and
logprobs of the run without the loss; a replica drained or shut down during a running
segment ends its reader's stream with a final output. (Without a store a lost session is a
404 naming the replica: test_serve_replicas.py checks it over HTTP, through this client.)"""

from __future__ import annotations

import asyncio
import time

import pytest
from distributed.conftest import replica_actor
from server.conftest import engine_args

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from loom.distributed.launch import start_replicas  # noqa: E402
from loom.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

PROMPT = [2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]  # three full blocks of 4
TIMEOUT_S = 60


def greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                          output_kind=RequestOutputKind.DELTA)


def slow_greedy(max_tokens: int, step_s: float = 0.03) -> SamplingParams:
    """Greedy with a logits processor that sleeps `step_s` per token: a segment that a drain
    or shutdown must stop, however fast the host decodes (400 tokens take 12 s, far past
    the stop). A local function, so Ray pickles it by value into the replica."""
    def pace(prompt, output, logits):
        time.sleep(step_s)
        return logits

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=0, output_kind=RequestOutputKind.DELTA,
                          logits_processors=[pace])


def run(coro, timeout: float = TIMEOUT_S):
    """Run a coroutine to its end, failing (not hanging) past `timeout`."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def stored(ray_instance, tiny_models, tmp_path_factory):
    """Two replicas sharing a folder store."""
    folder = tmp_path_factory.mktemp("kv")
    args = engine_args(tiny_models, kv_transfer_config={
        "kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(folder)}})
    began = time.monotonic()
    client = start_replicas(args, 2, app_name="stored", threads=1, num_cpus=0.5,
                            graceful_shutdown_timeout_s=20)
    print(f"2 replicas: {time.monotonic() - began:.1f} s")
    yield client
    client.shutdown()


async def segment(client, sid: str, fragment, max_tokens: int = 6):
    """One segment after `fragment`: its (token ids, logprob floats) and finish reason."""
    await client.start_segment(sid, greedy(max_tokens), fragment)
    tokens, logprobs, reason = [], [], None
    async for out in client.outputs(sid):
        completion = out.outputs[0]
        tokens += completion.token_ids
        logprobs += [{t: lp.logprob for t, lp in pos.items()} for pos in completion.logprobs]
        reason = completion.finish_reason or reason
    return tokens, logprobs, reason


def test_a_sessions_calls_stay_on_its_replica_and_new_requests_follow_the_prefix(stored):
    async def scenario():
        await stored.add_request("pin-a", PROMPT, None, session=True)
        home = stored.replica_of("pin-a")
        assert home in stored.running_replicas()
        for fragment in ([20, 21], [22], [23, 24, 25]):
            await segment(stored, "pin-a", fragment, max_tokens=3)
            assert stored.replica_of("pin-a") == home
        assert (await stored.get_session("pin-a")).status == "PAUSED"
        # A new request sharing the prompt's blocks goes where they were sent.
        outs = [o async for o in stored.generate(PROMPT + [30, 31], greedy(2), "pin-b")]
        assert outs[-1].finished and stored.replica_of("pin-b") == home
        readings = await stored.readings()
        assert sorted(r.replica for r in readings) == sorted(stored.running_replicas())
        # A round trip over the handle, measured for the report.
        began = time.perf_counter()
        for _ in range(20):
            await stored.holds("pin-a")
        print(f"holds over the handle: {(time.perf_counter() - began) / 20 * 1e3:.2f} ms")
        await stored.close("pin-a")
        assert stored.replica_of("pin-a") is None or not await stored.holds("pin-a")

    run(scenario())


def test_a_session_that_expires_on_its_replica_loses_its_pin(stored):
    from loom.distributed.directory import DIRECTORY_NAMESPACE, directory_name

    directory = ray.get_actor(directory_name("stored"), namespace=DIRECTORY_NAMESPACE)

    async def scenario():
        await stored.add_request("ttl-a", PROMPT, None, session=True, ttl_s=0.3)
        await segment(stored, "ttl-a", [60], max_tokens=1)
        assert ray.get(directory.lookup.remote("ttl-a")) == stored.replica_of("ttl-a")
        await asyncio.sleep(0.6)
        # The next step on that replica expires it (a request sharing its prefix goes there).
        [o async for o in stored.generate(PROMPT + [61], greedy(1), "ttl-b")]
        deadline = time.monotonic() + 10
        while ray.get(directory.lookup.remote("ttl-a")) is not None:
            assert time.monotonic() < deadline, "the expired session kept its pin"
            await asyncio.sleep(0.05)

    run(scenario())


def test_a_killed_replicas_session_continues_bit_identically_from_the_store(stored):
    async def conversation(sid: str, kill: bool):
        await stored.add_request(sid, PROMPT, None, session=True)
        first = await segment(stored, sid, [40, 41, 42])
        home = stored.replica_of(sid)
        if kill:
            ray.kill(replica_actor("stored", home), no_restart=True)
        second = await segment(stored, sid, [43, 44, 45, 46, 47])
        moved_to = stored.replica_of(sid)
        await stored.close(sid)
        return first, second, home, moved_to

    reference = run(conversation("kill-ref", kill=False))
    lost = run(conversation("kill-moved", kill=True))
    assert lost[3] != lost[2]  # the second segment ran on another replica
    assert lost[0] == reference[0]
    assert lost[1][0] == reference[1][0]  # tokens
    assert lost[1][1] == reference[1][1]  # logprobs, exact floats
    assert lost[1][2] == "length"


def test_a_drained_replica_ends_its_running_segment_with_a_final_output(stored):
    async def scenario():
        await stored.add_request("drain-a", [3, 4, 5, 6, 7], None, session=True)
        await stored.start_segment("drain-a", slow_greedy(400), None)
        home = stored.replica_of("drain-a")
        reader = asyncio.ensure_future(_collect(stored.outputs("drain-a")))
        await asyncio.sleep(0.3)
        stopped = await stored.drain_replica(home)
        outs = await asyncio.wait_for(reader, 20)
        return stopped, outs

    stopped, outs = run(scenario())
    assert stopped == ["drain-a"]
    assert outs and outs[-1].outputs[0].finish_reason is not None
    assert sum(len(o.outputs[0].token_ids) for o in outs) < 400


def test_a_replica_shut_down_by_serve_ends_its_segment_and_new_requests_move(stored):
    async def scenario():
        # A replica that is not drained: the one killed above is replaced by Serve.
        deadline = time.monotonic() + 60
        while not {r.replica for r in await stored.readings()} - set(stored.pins.known_gone()):
            assert time.monotonic() < deadline, "Serve did not replace the killed replica"
            await asyncio.sleep(0.1)
        await stored.add_request("stop-a", [3, 9, 5, 6, 7], None, session=True)
        await stored.start_segment("stop-a", slow_greedy(400), None)
        reader = asyncio.ensure_future(_collect(stored.outputs("stop-a")))
        await asyncio.sleep(0.3)
        deleting = asyncio.ensure_future(asyncio.to_thread(serve.delete, "stored"))
        outs = await asyncio.wait_for(reader, 30)
        await asyncio.wait_for(deleting, 60)
        return outs

    outs = run(scenario(), timeout=90)
    assert outs and outs[-1].outputs[0].finish_reason is not None
    assert sum(len(o.outputs[0].token_ids) for o in outs) < 400


async def _collect(stream):
    return [out async for out in stream]
