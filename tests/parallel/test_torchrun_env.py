"""Tensor parallelism across machines, as torchrun starts it, on one machine over loopback.

torchrun gives each process MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK; the
engine then starts no workers: the processes meet through MASTER_ADDR:MASTER_PORT, rank 0
drives, and rank 1 serves steps inside `LLM(...)` and leaves the process with SystemExit when
the driver shuts down. The test sets those variables by hand on two processes (torchrun's
agent is not needed to exercise the engine's side).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from processes import free_port

from loom import LLM, SamplingParams

PROMPT = "Once upon a time"
MAX_TOKENS = 8
TIMEOUT_S = 60.0
MARKER = "TOKENS "

SCRIPT = """
import json
import os
import sys

from loom import LLM, SamplingParams

llm = LLM(model=sys.argv[1], tensor_parallel_size=2, dtype="float32", quantization=None,
          device="cpu", num_kv_blocks=64)
# Only rank 0 gets here: rank 1 serves steps inside LLM(...) and exits with SystemExit.
assert os.environ["RANK"] == "0", "a rank above 0 returned from LLM(...)"
params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), ignore_eos=True)
out = llm.generate([sys.argv[2]], params)[0]
assert out.error is None, out.error
print("TOKENS " + json.dumps(list(out.outputs[0].token_ids)), flush=True)
llm.shutdown()
"""


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else "(no output)"


def test_two_processes_with_torchruns_environment_equal_one_device(tiny_models, tmp_path):
    folder, _ = tiny_models["qwen2"]
    script = tmp_path / "tp_script.py"
    script.write_text(SCRIPT)
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    try:
        for rank in range(2):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
                       OMP_NUM_THREADS="1", LOOM_TP_TIMEOUT_S="60")
            with open(logs[rank], "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(script), str(folder), PROMPT, str(MAX_TOKENS)],
                    env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
        # The reference, computed while the ranks load: one device touches no process group.
        llm = LLM(model=str(folder), dtype="float32", quantization=None, device="cpu",
                  num_kv_blocks=64)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        expected = list(llm.generate([PROMPT], params)[0].outputs[0].token_ids)
        llm.shutdown()
        codes = []
        for rank, proc in enumerate(procs):
            try:
                codes.append(proc.wait(timeout=TIMEOUT_S))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"rank {rank} did not exit within {TIMEOUT_S:.0f} s; its output:\n"
                    f"{_tail(logs[rank])}") from None
        assert codes == [0, 0], "\n".join(
            f"rank {r} exited {c}:\n{_tail(logs[r])}" for r, c in enumerate(codes))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = [line for line in logs[0].read_text().splitlines() if line.startswith(MARKER)]
    assert len(lines) == 1, _tail(logs[0])
    assert json.loads(lines[0][len(MARKER):]) == expected
    assert len(expected) == MAX_TOKENS
    assert MARKER not in logs[1].read_text()  # rank 1 never returned from LLM(...)
