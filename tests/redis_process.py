"""A throwaway `redis-server` of a test's own on a free loopback port (Debian's package)."""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from processes import free_port

HOST = "127.0.0.1"
START_TIMEOUT_S = 10.0


def _ping(port: int) -> bool:
    """Whether a Redis server on the port answers PING (a raw RESP exchange, no client)."""
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    """A running `redis-server` process: where it listens, and how to stop it."""

    host: str
    port: int
    process: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and wait until it has exited, so that
        the port refuses connections when this returns. Stopping twice does nothing."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


def start_redis(binary: str, folder: Path) -> RedisServer:
    """Start a server on a free port in `folder`; wait until it answers PING."""
    port = free_port(HOST)
    log = folder / "redis.log"
    args = [binary, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
            "--dir", str(folder), "--logfile", str(log), "--daemonize", "no"]
    process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    server = RedisServer(HOST, port, process, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if _ping(port):
            return server
        if process.poll() is not None:
            break  # exited: most likely the port was taken between choosing and binding
        time.sleep(0.01)
    server.stop()
    text = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
    raise RuntimeError(f"redis-server on port {port} did not start; its log:\n{text}")
