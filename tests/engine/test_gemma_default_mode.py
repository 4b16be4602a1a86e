"""The default mode on the real Gemma 3 270M (quantization="auto"): what it picks here, and
that a live session in it still sees the model a fresh forward pass sees."""

from __future__ import annotations

import pytest
import torch
from engine.helpers import run_to_completion

from loom import SamplingParams
from loom.engine.config import EngineArgs
from loom.engine.llm_engine import LLMEngine
from loom.engine.mode import HostInfo, choose_mode

PROMPT = "The lighthouse keeper wrote in his log every night. On the first night he wrote"


@pytest.fixture(scope="module")
def default_engine(gemma_path):
    """The engine `LLM(model="gemma3-270m")` builds, without prefix caching (so a second
    request over the same tokens is computed afresh)."""
    return LLMEngine.from_engine_args(EngineArgs(
        model=str(gemma_path), num_kv_blocks=256, enable_prefix_caching=False))


def test_the_default_is_the_mode_the_rules_choose_for_this_host(default_engine) -> None:
    host = HostInfo.detect("cpu")
    expected = choose_mode("auto", "auto", "auto", True, host)
    config = default_engine.config
    assert (config.dtype, config.quantization, config.kv_cache_dtype) == (
        expected.dtype, expected.quantization, expected.kv_cache_dtype)
    assert config.mode_summary == expected.describe(host)
    if host.cpu_kernels:
        assert config.quantization == "w4a8" and config.kv_cache_dtype == "float16"


def test_a_session_alternating_appends_and_generation_equals_a_fresh_forward(
    default_engine,
) -> None:
    """Appends and single-token decodes run the fused kernels; a fresh prompt runs the module
    path. Both round activations to int8 the same way, but float rounding differences between
    the paths flip a few roundings, so in w8a8 the logits agree to about 3% of their range
    (measured on this prompt: 0.60 of 22.6, where w8a8 differs from float32 by 1.17; in
    float32 and int8 modes the paths agree to 1e-5) and the greedy token is the same."""
    engine = default_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("live", PROMPT, greedy, session=True)
    run_to_completion(engine)
    engine.append("live", " that the sea was calm. On the second night")
    run_to_completion(engine)
    engine.resume("live", greedy)
    run_to_completion(engine)
    engine.append("live", " and then")
    run_to_completion(engine)
    live = engine.get_logits("live")
    ids = list(engine.get_session("live").token_ids)
    engine.add_request("fresh", ids, None, session=True)
    run_to_completion(engine)
    fresh = engine.get_logits("fresh")
    assert engine.num_recomputed_tokens == 0
    assert int(live.argmax()) == int(fresh.argmax())
    torch.testing.assert_close(live, fresh, atol=0.05 * float(fresh.abs().max()), rtol=0.0)
    for rid in ("live", "fresh"):
        engine.close(rid)
    assert engine.kv_pool_all_free
