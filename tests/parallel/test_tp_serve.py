"""`loom serve --tensor-parallel-size 2` as a user starts it: a real process whose worker
answers the openai client with TP=1's text, and whose Ctrl-C ends every worker."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from processes import alive, children, free_port, start_tiny_serve, wait_until_serving

from loom import LLM, SamplingParams

openai = pytest.importorskip("openai")
PROMPTS = ["The quick brown fox", "Once upon a time in a land"]


def test_serve_answers_the_openai_client_and_ctrl_c_ends_every_worker(tiny_models):
    folder, _ = tiny_models["gemma3"]
    port = free_port()
    server = start_tiny_serve(folder, port, "--tensor-parallel-size", "2")
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_serving(server, base, timeout=120)
        workers = children(server.pid)
        assert len(workers) == 1
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        response = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=8,
                                             temperature=0.0)
        offline = LLM(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=128,
                      block_size=4).generate(PROMPTS, SamplingParams(max_tokens=8,
                                                                     temperature=0.0),
                                             use_tqdm=False)
        assert [c.text for c in response.choices] == [o.outputs[0].text for o in offline]
        server.send_signal(signal.SIGINT)  # what Ctrl-C sends
        assert server.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(w) for w in workers)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_killed_driver_leaves_no_worker_behind(tiny_models):
    """SIGKILL of the driver (no atexit, no shutdown): its worker notices and exits."""
    folder, _ = tiny_models["qwen2"]
    script = (
        "import sys, time\n"
        "from loom import LLM\n"
        f"llm = LLM(model={str(folder)!r}, tensor_parallel_size=2, dtype='float32',"
        " device='cpu', num_kv_blocks=64, block_size=4)\n"
        "print(llm.engine.executor.workers[0].pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(driver.stdout.readline())
        assert alive(worker)
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 10
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(worker)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
