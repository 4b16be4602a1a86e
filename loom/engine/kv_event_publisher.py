"""`ZmqEventPublisher`: KV event batches over ZeroMQ, framed as vLLM frames them.

Every batch is one multipart message on a PUB socket:

    [topic, sequence number (8 bytes, big-endian, from 0), msgpack payload]

A subscriber that sees a gap in the sequence numbers asks the replay socket (ROUTER) for the
batches it missed: it sends `[b"", start (8 bytes, big-endian)]` (a REQ or DEALER socket) and
receives `[b"", seq, payload]` for every buffered batch with seq >= start, oldest first, then
the end marker `[b"", -1 as 8 signed big-endian bytes, b""]`. The last `buffer_steps` batches
are kept.

The engine's step only puts the payload on a bounded queue (`publish`); one background thread
owns both sockets from then on: it numbers, sends and buffers the batches and answers replay
requests, so no step waits on the network. Sockets are bound (or connected) in the
constructor, so a bad or busy address fails the engine's start, not a later step.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque

import zmq

from loom.errors import InvalidRequestError

logger = logging.getLogger("loom")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_MS = 50


def _binds(endpoint: str) -> bool:
    """vLLM's rule: an address with a wildcard, or ipc:// / inproc://, is bound (the stable
    side); any other address is connected to (a subscriber that binds)."""
    return ("*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


class ZmqEventPublisher:
    """Publishes encoded batches on a PUB socket with an in-memory replay buffer.

    Invariant: sequence numbers are consecutive from 0 in the order `publish` was called;
    a batch dropped because the queue was full gets none (subscribers see no gap for it,
    and `num_dropped` counts it)."""

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
    ) -> None:
        """The arguments are `KVEventsConfig`'s keys of the same names."""
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self.num_dropped = 0
        context = zmq.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self.endpoint = self._open(self._pub, endpoint, "endpoint", bind=_binds(endpoint))
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._open(self._replay, replay_endpoint,
                                                  "replay_endpoint", bind=True)
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="loom-kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(socket: zmq.Socket, endpoint: str, key: str, bind: bool) -> str:
        """Bind or connect; the address actually bound (a "*" port resolved)."""
        try:
            if bind:
                socket.bind(endpoint)
                return socket.getsockopt_string(zmq.LAST_ENDPOINT)
            socket.connect(endpoint)
            return endpoint
        except zmq.ZMQError as error:
            verb = "bind" if bind else "connect to"
            raise InvalidRequestError(f"kv_events_config.{key}: cannot {verb} {endpoint!r}: "
                                      f"{error}", param="kv_events_config") from None

    def publish(self, payload: bytes) -> None:
        """Queue one encoded batch; never blocks (a full queue drops it, with a warning)."""
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self.num_dropped += 1
            logger.warning("KV events: the publish queue is full, a batch was dropped "
                           "(%d so far)", self.num_dropped)

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to `timeout_s`), stop the thread, close the sockets."""
        if not self._thread.is_alive():
            self._close_sockets()
            return
        while True:  # the stop marker must get in, even behind a full queue
            try:
                self._queue.put(None, timeout=timeout_s)
                break
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self._queue.get_nowait()
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            logger.warning("KV events: the publisher thread did not stop in %.1f s", timeout_s)
            return  # it still owns the sockets; the daemon thread ends with the process
        self._close_sockets()

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None and not socket.closed:
                socket.close(linger=0)

    # ---- the publisher thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay is None:
                payload = self._queue.get()
            else:
                while self._replay.poll(0):
                    self._serve_replay()
                try:
                    payload = self._queue.get_nowait()
                except queue.Empty:
                    # Wake for a replay request, or look at the queue again this much later.
                    self._replay.poll(_POLL_MS)
                    continue
            if payload is None:
                return
            self._send(payload)

    def _send(self, payload: bytes) -> None:
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError:
            logger.exception("KV events: batch %d was not sent", seq)
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: ignored a malformed replay request (%d frames)",
                           len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
