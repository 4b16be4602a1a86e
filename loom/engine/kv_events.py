"""KV cache events in vLLM's wire format (`--kv-events-config`), so routers that track an
engine's prefix cache from vLLM's event stream (llm-d's precise prefix-cache scorer, NVIDIA
Dynamo's KV router, Ray's KV-aware router) track Loom the same way.

    prefix cache --(loom.core.kv_events)--> KVEventCollector
        --(KVEventStream.flush, once per engine step)--> KVEventBatch --msgpack-->
        publisher (loom.engine.kv_event_publisher: ZMQ PUB + replay ROUTER)

The wire format, as vLLM's msgspec structs encode it (`array_like=True`, `tag=True`,
`omit_defaults=True`): a batch is the msgpack array `[ts, events, data_parallel_rank]`
(`ts`: float seconds since the epoch); each event is an array whose first element is its
class name, then its fields in vLLM's order:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
     medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

`lora_id` and `lora_name` are always nil (Loom serves no LoRA adapters); `medium` names where
the blocks live (`KVEventsConfig.medium`). With `encoding="map"` each event is instead the
map `{"type": <class name>, <field>: <value>, ...}` that vLLM publishes since it dropped
`array_like` from its event structs (the batch stays an array); decoders of the array form
(every llm-d, Dynamo and SGLang router release, and vLLM's own types before that change) are
the wider audience, hence the default.

Block hashes: Loom's keys are 16-byte BLAKE2b digests; on the wire each is the unsigned
64-bit integer of its last 8 bytes, big-endian (`wire_hash`). That is what vLLM sends when it
converts its byte hashes to integers (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`), what llm-d's
decoder derives from a byte hash itself, and the only form Dynamo's decoder accepts (a signed
or unsigned 64-bit integer, not bytes).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol

import msgpack

from loom.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventCollector,
)
from loom.errors import InvalidRequestError

logger = logging.getLogger("loom")

_PUBLISHERS = ("null", "zmq")
_ENCODINGS = ("array", "map")
_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `KVEventsConfig` keys, plus Loom's `medium` and `encoding`.

    `enable_kv_cache_events`: collect and publish events (off: the cache appends nothing).
    `publisher`: "zmq", or "null" (collected, then dropped); None: "zmq" when enabled.
    `endpoint`: the PUB socket's address; bound when it has a wildcard ("*", "::") or is
    ipc:// or inproc://, else connected (vLLM's rule); "tcp://127.0.0.1:*" binds a free port.
    `replay_endpoint`: a ROUTER socket (always bound) answering an 8-byte big-endian start
    sequence number with the buffered batches from there, then an end marker; None: none.
    `buffer_steps`: batches kept for replay. `hwm`: the PUB socket's send high-water mark.
    `max_queue_size`: batches waiting for the publisher thread at most (more are dropped,
    with a warning, so a step never waits on the network). `topic`: the first frame of
    every message (llm-d reads "kv@<pod>@<model>").
    `medium`: the event's `medium` field; None: the device's kind ("GPU" on CUDA, "CPU" on
    a CPU). `encoding`: "array" (vLLM's positional structs) or "map" (see the module).
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    medium: str | None = None
    encoding: str = "array"

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            _bad("enable_kv_cache_events", "must be true or false", self.enable_kv_cache_events)
        if self.publisher is None:
            object.__setattr__(self, "publisher",
                               "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in _PUBLISHERS:
            _bad("publisher", f"must be one of {list(_PUBLISHERS)}", self.publisher)
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(self, key)
            if value is None and key == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(_SCHEMES):
                _bad(key, "must be a ZMQ address starting with tcp://, ipc:// or inproc:// "
                     "(e.g. 'tcp://*:5557')", value)
        for key, least in (("buffer_steps", 0), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                _bad(key, f"must be an integer >= {least}", value)
        if not isinstance(self.topic, str):
            _bad("topic", "must be a string", self.topic)
        if self.medium is not None and (not isinstance(self.medium, str) or not self.medium):
            _bad("medium", "must be a non-empty string such as 'GPU' or 'CPU'", self.medium)
        if self.encoding not in _ENCODINGS:
            _bad("encoding", f"must be one of {list(_ENCODINGS)}", self.encoding)

    @classmethod
    def coerce(cls, value: KVEventsConfig | Mapping[str, Any] | str) -> KVEventsConfig:
        """The config as given, or built from a dict of its keys or that dict as JSON (the
        `--kv-events-config` flag); unknown keys are refused by name."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as error:
                raise InvalidRequestError(f"kv_events_config is not JSON: {error}",
                                          param="kv_events_config") from None
        if not isinstance(value, Mapping):
            raise InvalidRequestError(
                "kv_events_config must be a KVEventsConfig, a dict or a JSON object such as "
                '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}, got '
                f"{type(value).__name__}", param="kv_events_config")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise InvalidRequestError(
                f"kv_events_config: unknown key(s) {unknown}; known: {known}",
                param="kv_events_config")
        return cls(**value)


def _bad(key: str, rule: str, value: object) -> None:
    raise InvalidRequestError(f"kv_events_config.{key} {rule}, got {value!r}",
                              param="kv_events_config")


def default_medium(device: str) -> str:
    """The `medium` of blocks in a KV pool on `device` ("cuda:0" -> "GPU", "cpu" -> "CPU")."""
    kind = device.split(":", 1)[0]
    return "GPU" if kind == "cuda" else kind.upper()


# ---- the wire format --------------------------------------------------------------------


def wire_hash(block_hash: bytes) -> int:
    """A block key on the wire: the unsigned 64-bit integer of its last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


def wire_event(event: KVCacheEvent, medium: str, encoding: str = "array") -> list | dict:
    """One event as vLLM's msgspec struct encodes it (see the module docstring)."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        values: list[tuple[str, Any]] = [
            ("block_hashes", [wire_hash(h) for h in event.block_hashes]),
            ("parent_block_hash", None if parent is None else wire_hash(parent)),
            ("token_ids", list(event.token_ids)),
            ("block_size", event.block_size),
            ("lora_id", None),
            ("medium", medium),
            ("lora_name", None),
        ]
    elif isinstance(event, BlockRemoved):
        values = [("block_hashes", [wire_hash(h) for h in event.block_hashes]),
                  ("medium", medium)]
    elif isinstance(event, AllBlocksCleared):
        values = []
    else:
        raise TypeError(f"not a KV cache event: {event!r}")
    tag = type(event).__name__
    if encoding == "map":
        return {"type": tag, **dict(values)}
    return [tag, *(v for _, v in values)]


@dataclass(frozen=True)
class KVEventBatch:
    """The events of one engine step, stamped with the wall time they were published at."""

    ts: float
    events: tuple[KVCacheEvent, ...]
    data_parallel_rank: int = 0

    def encode(self, medium: str, encoding: str = "array") -> bytes:
        """The msgpack payload: `[ts, [event, ...], data_parallel_rank]`."""
        events = [wire_event(e, medium, encoding) for e in self.events]
        return msgpack.packb([float(self.ts), events, self.data_parallel_rank])


class EventPublisher(Protocol):
    """Sends encoded batches in order without blocking the caller (one per `publish`)."""

    def publish(self, payload: bytes) -> None: ...

    def shutdown(self) -> None: ...


class NullEventPublisher:
    """Publishes nothing (`publisher: "null"`)."""

    def publish(self, payload: bytes) -> None:
        pass

    def shutdown(self) -> None:
        pass


class KVEventStream:
    """The prefix cache's events, published once per engine step as one batch.

    Owns the collector the `KVCacheManager` appends to and the publisher; `flush` takes what
    was collected (nothing: no batch) and hands the encoded batch to the publisher, which
    sends it from its own thread."""

    def __init__(self, config: KVEventsConfig, device: str,
                 publisher: EventPublisher | None = None) -> None:
        self.config = config
        self.medium = config.medium or default_medium(device)
        self.collector = KVEventCollector()
        self.num_batches = 0
        if publisher is None:
            publisher = NullEventPublisher()
            if config.publisher == "zmq":
                from loom.engine.kv_event_publisher import ZmqEventPublisher

                publisher = ZmqEventPublisher(
                    config.endpoint, config.replay_endpoint, config.buffer_steps, config.hwm,
                    config.max_queue_size, config.topic)
        self.publisher = publisher
        self._closed = False

    def flush(self) -> KVEventBatch | None:
        """Publish the events collected since the last flush as one batch (returned); None
        when there were none or the stream is shut down."""
        events = self.collector.take()
        if not events or self._closed:
            return None
        batch = KVEventBatch(time.time(), tuple(events))
        self.publisher.publish(batch.encode(self.medium, self.config.encoding))
        self.num_batches += 1
        return batch

    def shutdown(self) -> None:
        """Publish what is left, then stop the publisher (its sockets are closed). Idempotent."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self.publisher.shutdown()


def create_kv_event_stream(config: KVEventsConfig | None, device: str) -> KVEventStream | None:
    """The stream `config` asks for, or None when events are off (no collector is attached,
    so the cache pays nothing)."""
    if config is None or not config.enable_kv_cache_events:
        return None
    return KVEventStream(config, device)
