"""The KV connector examples run end to end as a user runs them (`run.sh` in a work folder):
examples/segmented_prefill (gaps computed inside a loaded range give the full load's text)
and examples/disaggregated_prefill (a consumer decoding from a producer's KV gives a single
process's text), on a tiny random-weight Gemma 3 and on the real Gemma 3 270M."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from loom.kernels.build import runnable_variants

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# Variables the examples (and the engine's kernel choice) read: the tests set them, never
# inherit them, so a run does not depend on the environment it was started from.
EXAMPLE_VARS = ("LOOM_MODEL", "LOOM_EXAMPLE_WORDS", "LOOM_BLOCK_SIZE", "LOOM_EXAMPLE_DIR",
                "SEGMENTED_PREFILL_BREAK", "LOOM_CPU_KERNEL_VARIANT", "LOOM_CPU_KERNELS")


@pytest.fixture(params=["tiny", pytest.param("gemma", marks=pytest.mark.slow)])
def model_env(request) -> dict[str, str]:
    """The examples' model settings: a tiny random-weight Gemma 3 folder (its context is 512
    tokens, so shorter prompts), or nothing for the default model, gemma3-270m."""
    if request.param == "tiny":
        folder = request.getfixturevalue("tiny_models")["gemma3"][0]
        return {"LOOM_MODEL": str(folder), "LOOM_EXAMPLE_WORDS": "30"}
    return {}


def run_example(name: str, work_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`examples/<name>/run.sh` with this interpreter, working in `work_dir`."""
    full_env = {k: v for k, v in os.environ.items() if k not in EXAMPLE_VARS}
    full_env.update(PYTHON=sys.executable, LOOM_EXAMPLE_DIR=str(work_dir), **env)
    return subprocess.run(
        ["bash", str(EXAMPLES / name / "run.sh")],
        env=full_env, capture_output=True, text=True, timeout=900, check=False,
    )


def report(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def kv_stats(stdout: str, label: str) -> dict[str, int]:
    """The counters decode_example.py printed for one decode stage."""
    match = re.search(rf"kv stats \({label}\): (.*)", stdout)
    assert match, f"no kv stats line for {label!r}"
    return {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", match.group(1))}


def test_segmented_prefill_example(tmp_path, model_env):
    result = run_example("segmented_prefill", tmp_path, model_env)
    assert result.returncode == 0, report(result)
    assert "Outputs match" in result.stdout, report(result)
    full, segmented = (kv_stats(result.stdout, label)
                       for label in ("full load", "segmented prefill"))
    # The gaps were real: the engine computed them instead of loading them, and every
    # matched token was either loaded or computed, none lost and none failed.
    assert segmented["kv_gap_tokens"] > 0 and segmented["kv_loaded_tokens"] > 0
    assert full["kv_gap_tokens"] == 0
    assert full["kv_loaded_tokens"] == segmented["kv_loaded_tokens"] + segmented["kv_gap_tokens"]
    assert full["kv_load_failed_tokens"] == segmented["kv_load_failed_tokens"] == 0
    pictures = re.findall(r"\[segmented prefill\] \S+: ([CE-]+) ", result.stdout)
    assert len(pictures) == 4 and all("-" in p and p.endswith("E") for p in pictures), pictures
    decoded = (tmp_path / "decode_output.txt").read_text()
    assert decoded == (tmp_path / "segmented_prefill_decode_output.txt").read_text()
    assert decoded.count("Generated text:") == 4


def test_disaggregated_prefill_example(tmp_path, model_env):
    result = run_example("disaggregated_prefill", tmp_path, model_env)
    assert result.returncode == 0, report(result)
    assert "Outputs match" in result.stdout, report(result)
    loaded, expected = map(int, re.search(
        r"consumer: kv_loaded_tokens=(\d+) \(expected (\d+)\)", result.stdout).groups())
    assert loaded == expected > 0, report(result)
    assert (tmp_path / "consumer_output.txt").read_text() == \
        (tmp_path / "baseline_output.txt").read_text()


@pytest.mark.slow
@pytest.mark.skipif(len(runnable_variants()) < 2, reason="this host runs one kernel variant")
@pytest.mark.parametrize(("example", "output"), [
    ("disaggregated_prefill", "consumer_output.txt"),
    ("segmented_prefill", "segmented_prefill_decode_output.txt"),
])
def test_example_text_is_the_same_on_every_host_kind(tmp_path, example, output):
    """The default model's examples on the widest kernel variant this host runs and on plain
    AVX2 (what an AVX2-only host runs): byte-identical texts, so an example's output does not
    depend on the host."""
    texts = []
    for variant in (runnable_variants()[0], "avx2"):
        work = tmp_path / variant
        work.mkdir()
        result = run_example(example, work, {"LOOM_CPU_KERNEL_VARIANT": variant})
        assert result.returncode == 0 and "Outputs match" in result.stdout, report(result)
        texts.append((work / output).read_text())
    assert texts[0] == texts[1]


def test_segmented_prefill_check_fails_when_gaps_are_not_computed(tmp_path, tiny_models):
    """SEGMENTED_PREFILL_BREAK=1: the connector skips loading its gaps but hides them from the
    engine, so those blocks are neither loaded nor computed. Both checks must fail: the text
    differs from the full load's, and the engine's gap count is not the connector's."""
    env = {"LOOM_MODEL": str(tiny_models["gemma3"][0]), "LOOM_EXAMPLE_WORDS": "30",
           "SEGMENTED_PREFILL_BREAK": "1"}
    result = run_example("segmented_prefill", tmp_path, env)
    assert result.returncode == 1, report(result)
    assert "Outputs differ" in result.stdout and "Outputs match" not in result.stdout
    assert "FAILED (segmented prefill): the engine computed 0 gap tokens" in result.stderr
    assert kv_stats(result.stdout, "segmented prefill")["kv_gap_tokens"] == 0


def test_gap_pattern():
    """Gaps of 1, 2, 3 ... blocks between loaded runs of the same sizes, the last block
    always loaded, starting wherever the match starts."""
    path = EXAMPLES / "segmented_prefill" / "segmented_prefill_example_connector.py"
    spec = importlib.util.spec_from_file_location("segmented_prefill_example_connector", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def draw(num_computed_blocks: int, num_blocks: int) -> str:
        gaps = module.choose_gaps(num_computed_blocks, num_computed_blocks + num_blocks, 4)
        return module.picture(num_computed_blocks * 4, num_blocks * 4, gaps, 4)

    assert draw(0, 2) == "-E"
    assert draw(0, 12) == "-E--EE---EEE"
    assert draw(0, 16) == "-E--EE---EEE---E"
    assert draw(2, 6) == "CC-E--EE"
    for n in range(2, 40):
        assert draw(0, n).endswith("E") and draw(0, n).startswith("-")
