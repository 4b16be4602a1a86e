"""The real Gemma 3 270M split over two ranks, exact float32: transformers' greedy tokens, and
the fork/join scene (children share the parent's KV on every rank) equal to fresh passes."""

from __future__ import annotations

import pytest
from engine.fork_join_scene import check_fork_join_scene
from engine.test_gemma_real import assert_prompts_greedy_match

from loom.demo_fork import fork_join_kwargs
from loom.engine.config import EngineArgs
from loom.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(gemma_path):
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(gemma_path), dtype="float32", quantization=None, num_kv_blocks=512,
        max_num_batched_tokens=256, tensor_parallel_size=2,
        special_kwargs=fork_join_kwargs(promise="<unused0>", sync="<unused1>")))
    yield engine
    assert engine.kv_pool_all_free
    engine.shutdown()


def test_greedy_continuations_equal_transformers(engine, gemma_hf):
    assert_prompts_greedy_match(engine, gemma_hf, "tp")


def test_fork_join_scene_equals_fresh_forward(engine, gemma_hf):
    check_fork_join_scene(engine, gemma_hf, request_id="tp-outline")
