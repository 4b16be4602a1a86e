"""Helpers for tests that start servers and processes: a free loopback port, which
processes are alive or whose children they are (read from /proc), and waiting for a
`loom serve` process to answer."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now on `host` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat after the command name (state, ppid, ...), or None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(entry.name)
            if fields is not None and int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def wait_until_serving(process, base_url: str, timeout: float) -> None:
    """Wait until a `loom serve` process answers `GET /health` with 200; fail (naming why)
    if it exits first or takes longer than `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, f"loom serve exited with {process.returncode}"
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "loom serve did not come up"
        time.sleep(0.25)


def start_tiny_serve(folder, port: int, *flags: str, quiet: bool = False) -> subprocess.Popen:
    """`loom serve` on a tiny model folder as a user starts it (served as "tiny", float32 on
    the CPU, 128 KV blocks of 4, on `port`), with `flags` added; `quiet` drops its output."""
    output = subprocess.DEVNULL if quiet else None
    return subprocess.Popen(
        [sys.executable, "-m", "loom.cli", "serve", "--model", str(folder),
         "--served-model-name", "tiny", *flags, "--device", "cpu", "--dtype", "float32",
         "--num-kv-blocks", "128", "--block-size", "4", "--port", str(port),
         "--log-level", "warning"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=output, stderr=output,
    )
