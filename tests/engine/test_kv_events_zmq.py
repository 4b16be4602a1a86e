"""KV cache events over ZMQ in vLLM's wire format, read as a KV-aware router reads them: a SUB
socket and plain msgpack (no Loom code on the subscriber's side).

A prefix-cached prompt's full blocks arrive as BlockStored (hashes, parent chain, tokens,
block size), a repeat of the prompt stores nothing new, another prompt that needs the whole
pool evicts them (BlockRemoved), a reset clears everything (AllBlocksCleared), and the replay
socket returns the buffered batches byte for byte."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from engine.helpers import make_engine, prompt_ids, run_to_completion

from loom import SamplingParams
from loom.core.block_hash import extend_block_hashes
from loom.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from loom.engine.kv_event_publisher import END_SEQ, ZmqEventPublisher
from loom.engine.kv_events import KVEventsConfig, wire_event, wire_hash
from loom.errors import LoomError

BLOCK = 4
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
TOPIC = "kv@pod-0@tiny"


def receive(sub: zmq.Socket, timeout_s: float = 5.0) -> list[tuple[int, bytes]]:
    """Every (sequence number, payload) that arrives until the stream is quiet for 0.3 s."""
    got = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and sub.poll(300):
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC.encode()
        got.append((int.from_bytes(seq, "big"), payload))
    return got


def events_of(batches: list[tuple[int, bytes]]) -> list[list]:
    """The decoded events of the batches, in order (each batch is [ts, events, dp_rank])."""
    events = []
    for _, payload in batches:
        ts, batch_events, rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
        events += batch_events
    return events


@pytest.fixture
def events_engine(tiny_models):
    """A tiny engine of 8 blocks of 4 tokens publishing KV events on free loopback ports,
    and a SUB socket connected to it; both closed at the end."""
    folder, _ = tiny_models["gemma3"]
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
              "buffer_steps": 100, "topic": TOPIC}
    engine = make_engine(folder, num_kv_blocks=8, block_size=BLOCK, kv_events_config=config)
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(engine.kv_events.publisher.endpoint)
        time.sleep(0.3)  # a PUB socket drops what it sends before the subscription arrives
        yield engine, sub
    finally:
        sub.close(linger=0)
        engine.shutdown()


def test_a_subscriber_sees_a_prefix_cached_prompt_stored_then_removed(events_engine):
    engine, sub = events_engine
    prompt = prompt_ids(13, 1)  # 3 full blocks of 4 and one token
    engine.add_request("a", prompt, ONE_TOKEN)
    run_to_completion(engine)
    batches = receive(sub)
    (stored,) = events_of(batches)
    keys = [wire_hash(k) for k in extend_block_hashes([], prompt, BLOCK, 3)]
    # vLLM's positional BlockStored: tag, hashes, parent, tokens, block size, lora_id,
    # medium, lora_name.
    assert stored == ["BlockStored", keys, None, prompt[:12], BLOCK, None, "CPU", None]
    assert all(0 <= k < 2**64 for k in keys)

    # The same prompt again is served from the cache: nothing new is stored.
    engine.add_request("a2", prompt, ONE_TOKEN)
    run_to_completion(engine)
    assert engine.stats.prefix_cache_hits == 12
    assert receive(sub, timeout_s=1.0) == []

    # A longer prompt continuing it stores only its new blocks, chained on the prompt's last.
    longer = prompt[:12] + prompt_ids(5, 9)
    engine.add_request("b", longer, ONE_TOKEN)
    run_to_completion(engine)
    more = receive(sub)
    (stored_b,) = events_of(more)
    key_b = wire_hash(extend_block_hashes([], longer, BLOCK, 4)[3])
    assert stored_b[:5] == ["BlockStored", [key_b], keys[2], longer[12:16], BLOCK]

    # A prompt needing all 8 blocks evicts every cached one.
    engine.add_request("c", prompt_ids(29, 5), ONE_TOKEN)
    run_to_completion(engine)
    evicting = receive(sub)
    events = events_of(evicting)
    removed = [e for e in events if e[0] == "BlockRemoved"]
    assert len(removed) == 1 and removed[0][2] == "CPU"
    assert sorted(removed[0][1]) == sorted([*keys, key_b])
    assert [e[0] for e in events] == ["BlockRemoved", "BlockStored"]
    assert len(events[1][1]) == 7  # the new prompt's full blocks

    engine.reset_prefix_cache()
    cleared = receive(sub)
    assert events_of(cleared) == [["AllBlocksCleared"]]

    # Sequence numbers count the batches from 0, with no gap.
    published = batches + more + evicting + cleared
    assert [seq for seq, _ in published] == list(range(len(published)))

    # The replay socket answers a start sequence number with the buffered batches from
    # there, byte for byte, then the end marker.
    assert replay_from(engine.kv_events.publisher.replay_endpoint, 1) == published[1:]


def replay_from(replay_endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Ask the replay socket for the batches from `start`: (seq, payload) until the end
    marker."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return replayed
            replayed.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def test_the_replay_buffer_keeps_the_last_buffer_steps_batches():
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=2)
    try:
        payloads = [msgpack.packb([float(i), [], 0]) for i in range(4)]
        for payload in payloads:
            publisher.publish(payload)
        deadline = time.monotonic() + 5
        while (replayed := replay_from(publisher.replay_endpoint, 0)) != [
                (2, payloads[2]), (3, payloads[3])]:  # until the thread has sent all four
            assert time.monotonic() < deadline, replayed
            time.sleep(0.05)
        assert replay_from(publisher.replay_endpoint, 3) == [(3, payloads[3])]
        assert replay_from(publisher.replay_endpoint, 9) == []
    finally:
        publisher.shutdown()


def test_wire_events_match_vllms_structs_in_both_encodings():
    key = bytes(range(16))
    assert wire_hash(key) == int.from_bytes(bytes(range(8, 16)), "big")
    stored = BlockStored((key,), None, (1, 2), 2)
    assert wire_event(stored, "GPU") == ["BlockStored", [wire_hash(key)], None, [1, 2], 2, None,
                                         "GPU", None]
    assert wire_event(stored, "GPU", "map") == {
        "type": "BlockStored", "block_hashes": [wire_hash(key)], "parent_block_hash": None,
        "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
        "lora_name": None}
    assert wire_event(BlockRemoved((key,)), "CPU") == ["BlockRemoved", [wire_hash(key)], "CPU"]
    assert wire_event(AllBlocksCleared(), "CPU") == ["AllBlocksCleared"]
    assert wire_event(AllBlocksCleared(), "CPU", "map") == {"type": "AllBlocksCleared"}


@pytest.mark.parametrize(("config", "key"), [
    ({"enable_kv_cache_events": True, "buffer_steps": -1}, "buffer_steps"),
    ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher"),
    ({"enable_kv_cache_events": True, "endpoint": "localhost:5557"}, "endpoint"),
    ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events"),
    ({"enable_kv_cache_events": True, "endpont": "tcp://*:5557"}, "endpont"),
    ('{"enable_kv_cache_events": true, "encoding": "json"}', "encoding"),
    ("{not json", "kv_events_config"),
])
def test_a_bad_config_names_its_key(config, key):
    with pytest.raises(LoomError, match=key):
        KVEventsConfig.coerce(config)


def test_a_bad_config_fails_the_engine_start_and_the_flag_parses(tiny_models):
    import argparse

    from loom.server.cli import add_engine_args, engine_args_from

    folder, _ = tiny_models["gemma3"]
    with pytest.raises(LoomError, match="hwm"):
        make_engine(folder, kv_events_config={"enable_kv_cache_events": True, "hwm": "big"})
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(
        ["--kv-events-config", '{"enable_kv_cache_events": true, "topic": "kv@p@m"}']))
    config = KVEventsConfig.coerce(args.kv_events_config)
    assert config.publisher == "zmq" and config.topic == "kv@p@m"
    assert KVEventsConfig().publisher == "null"
