"""`loom serve --replicas 2` as a user starts it: a real process that starts its own Ray
instance, answers the openai client from two replicas (the response naming its replica),
keeps a session on its replica, and whose Ctrl-C ends Ray with it."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
from processes import alive, children, free_port, start_tiny_serve, wait_until_serving

openai = pytest.importorskip("openai")
pytest.importorskip("ray.serve")


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Ray's daemons are its children's children)."""
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def test_serve_replicas_answers_the_openai_client_and_ctrl_c_ends_ray(tiny_models):
    folder, _ = tiny_models["gemma3"]
    port = free_port()
    server = start_tiny_serve(folder, port, "--replicas", "2", "--replica-threads", "1",
                              quiet=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_serving(server, base, timeout=180)
        ray_processes = descendants(server.pid)
        assert ray_processes  # Ray's daemons and the two replicas' workers

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt="The quick brown fox", max_tokens=4, temperature=0.0)
        assert raw.parse().choices[0].finish_reason == "length"
        assert raw.headers["x-loom-replica"]

        opened = httpx.post(f"{base}/v1/sessions", json={"prompt": "Once upon a time"},
                            timeout=60)
        sid, home = opened.json()["id"], opened.headers["x-loom-replica"]
        for text in (" there", " was"):
            turn = httpx.post(f"{base}/v1/sessions/{sid}/append",
                              json={"text": text, "max_tokens": 3, "temperature": 0},
                              timeout=60)
            assert turn.status_code == 200 and turn.headers["x-loom-replica"] == home

        server.send_signal(signal.SIGINT)  # what Ctrl-C sends
        assert server.wait(timeout=90) == 0
        deadline = time.monotonic() + 30
        while any(alive(p) for p in ray_processes) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in ray_processes), "Ray outlived loom serve"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
