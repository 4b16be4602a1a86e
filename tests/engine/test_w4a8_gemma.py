"""quantization="w4a8" on the real Gemma 3 270M Q4_K_M: every matrix is computed from the
file's own blocks (Q4_K and Q6_K for attention output and feed-forward down; Q5_0 and Q8_0,
the K-quants' fallback for the 640-wide inputs, for q/k/v and gate/up; the Q8_0 embedding
for the tied output projection and the lookups); outputs do not depend on the batch, the
chunking, the prefix cache or a session's fragments (the default mode's guarantee), and
stay near the float model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine.helpers import run_to_completion
from engine.test_batch_invariance_gemma import (
    _passage,
    _sessions_in_three_fragments,
    differences,
    generate,
)

from loom import SamplingParams
from loom.engine.config import EngineArgs
from loom.engine.llm_engine import LLMEngine
from loom.kernels import cpu_kernels_available
from loom.loader.gguf_reader import GGUFFile
from loom.models.quant import Int8Linear
from loom.models.w4a8 import W4A8Embedding, W4A8Linear
from loom.tokenizer import load_tokenizer

pytestmark = pytest.mark.skipif(not cpu_kernels_available(),
                                reason="w4a8 runs on Loom's CPU kernels")
LENGTHS = (30, 140, 400)
Q5_0, Q8_0, Q4_K, Q6_K = 6, 8, 12, 14


def w4a8_engine(gemma_path, **kwargs) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(
        model=str(gemma_path), quantization="w4a8", num_kv_blocks=512, **kwargs))


@pytest.fixture(scope="module")
def engine(gemma_path) -> LLMEngine:
    return w4a8_engine(gemma_path)


@pytest.fixture(scope="module")
def prompts(gemma_path) -> list[list[int]]:
    ids = load_tokenizer(gemma_path).encode(_passage(30), add_special_tokens=True)
    return [ids[:1] + ids[1 + 5 * k: length + 5 * k] for k, length in enumerate(LENGTHS)]


def test_k_quant_matrices_are_computed_from_the_files_blocks(engine, gemma_path) -> None:
    model = engine.runner.model
    layers = model.model.layers
    reader = GGUFFile(gemma_path)
    files = {t.name: t for t in reader.tensors}
    for i, layer in enumerate(layers):
        o_proj, down = layer.self_attn.o_proj, layer.mlp.down_proj
        assert isinstance(o_proj, W4A8Linear) and o_proj.types == [Q4_K]
        down_type = int(files[f"blk.{i}.ffn_down.weight"].qtype)
        assert isinstance(down, W4A8Linear) and down.types == [down_type]
        assert down_type in (Q4_K, Q6_K)
        # q/k/v and gate/up read 640 inputs (not whole super-blocks): Q5_0, v sometimes Q8_0
        qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
        v_type = int(files[f"blk.{i}.attn_v.weight"].qtype)
        assert isinstance(qkv, W4A8Linear) and qkv.types == [Q5_0, Q5_0, v_type]
        assert v_type in (Q5_0, Q8_0)
        assert isinstance(gate_up, W4A8Linear) and gate_up.types == [Q5_0, Q5_0]
    # The tied output projection and the lookups share the Q8_0 embedding's packed blocks.
    assert isinstance(model.lm_head, W4A8Linear) and model.lm_head.types == [Q8_0]
    assert isinstance(model.model.embed_tokens, W4A8Embedding)
    assert model.model.embed_tokens.packed is model.lm_head.packed_0
    assert not any(isinstance(m, Int8Linear) for m in model.modules())
    # The weights are the file's, bit for bit (no second quantisation).
    from gguf.quants import dequantize

    for name, module in (("blk.0.attn_output.weight", layers[0].self_attn.o_proj),
                         ("blk.0.ffn_gate.weight", layers[0].mlp.gate_up_proj),
                         ("token_embd.weight", model.lm_head)):
        tensor = files[name]
        want = np.asarray(dequantize(reader.tensor_data(tensor), tensor.qtype),
                          dtype=np.float32)
        want = torch.from_numpy(want.reshape(-1, module.in_features))
        got = module.dequantized_weight()
        assert torch.equal(got[:want.shape[0]], want), name
    # Every step runs in one C call, the w4a8 layers included (built at the first step).
    engine.add_request("first", "Hello", SamplingParams(temperature=0.0, max_tokens=2))
    run_to_completion(engine)
    assert model.fused_decoder is not None and model.fused_decoder.max_tokens is None, (
        model.fused_decode_status)
    assert engine.config.quantization == "w4a8"
    assert engine.config.mode_summary.startswith("w4a8")


def test_outputs_do_not_depend_on_batch_chunks_cache_or_fragments(gemma_path,
                                                                     prompts) -> None:
    alone_engine = w4a8_engine(gemma_path, enable_prefix_caching=False,
                               max_num_batched_tokens=1024)
    alone = [generate(alone_engine, [ids], f"alone-{i}")[0] for i, ids in enumerate(prompts)]
    engine = w4a8_engine(gemma_path)
    chunked = w4a8_engine(gemma_path, max_num_batched_tokens=48)
    problems = {}
    for name, got in (
        ("one batch, cold", generate(engine, prompts, "cold")),
        ("again (prefix-cache hits)", generate(engine, prompts, "again")),
        ("chunks of 48 tokens", generate(chunked, prompts, "chunked")),
        ("sessions in three fragments", _sessions_in_three_fragments(chunked, prompts)),
    ):
        lines = differences(got, alone, prompts)
        if lines:
            problems[name] = lines
    assert engine.stats.prefix_cache_hits > 0
    assert not problems, problems
    assert engine.kv_pool_all_free and chunked.kv_pool_all_free


def test_logits_stay_near_the_float_model(engine, gemma_path, prompts) -> None:
    """The rounding of activations to int8 and the file's 4-bit weights are the only
    differences from exact float (the float mode dequantises the same file)."""
    exact = LLMEngine.from_engine_args(EngineArgs(
        model=str(gemma_path), quantization=None, num_kv_blocks=256))
    logits = {}
    for name, eng in (("w4a8", engine), ("float", exact)):
        eng.add_request(f"q-{name}", prompts[1], None, session=True)
        run_to_completion(eng)
        logits[name] = eng.get_logits(f"q-{name}")
        eng.close(f"q-{name}")
    ref = logits["float"]
    assert int(logits["w4a8"].argmax()) == int(ref.argmax())
    worst = float((logits["w4a8"] - ref).abs().max())
    assert worst < 0.1 * float(ref.abs().max()), worst


def test_a_second_load_reads_the_prepared_weights_and_computes_the_same_bits(
    gemma_path, tmp_path, monkeypatch,
) -> None:
    """The first w4a8 load repacks the file and saves the prepared model; the second builds
    the same layers from that file (no GGUF parsing) and gives the same logits."""
    from loom.runner.loading import build_model
    from loom.runner.prepared import prepared_path, wait_for_prepared_writes

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    _, first = build_model(gemma_path, quantization="w4a8")
    cache = prepared_path(gemma_path, torch.float32, "w4a8", "packed")
    wait_for_prepared_writes(cache)  # written on a thread while the model is ready
    assert cache.is_file()
    _, second = build_model(gemma_path, quantization="w4a8")
    assert [type(m) for m in first.modules()] == [type(m) for m in second.modules()]
    down_a, down_b = first.model.layers[3].mlp.down_proj, second.model.layers[3].mlp.down_proj
    assert isinstance(down_b, W4A8Linear) and down_b.types == down_a.types
    assert torch.equal(down_a.packed_0, down_b.packed_0)
    x = torch.randn(3, down_a.in_features, generator=torch.Generator().manual_seed(0))
    assert torch.equal(down_a(x), down_b(x))
