"""w4a8 on a Llama-architecture GGUF whose every matrix is a K-quant (Q4_K_M's mix: Q6_K for
v, down and the tied embedding, Q4_K elsewhere, and one Q5_K matrix, up, as Q5_K_M files
store most of theirs): every linear layer and the embedding come
from the file's blocks (llama.cpp's q/k row permutation undone on the blocks as on the
values), a step's logits do not depend on how its tokens were split into steps, match the
exact float model of the same file to activation rounding, and a prepared-cache load builds
the same model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_gguf import F16, FFN, HEADS, HIDDEN, KV_HEADS, Q4_K, Q5_K, Q6_K, VOCAB, write_tiny_llama
from tiny_models import chunk

from loom.kernels import cpu_kernels_available
from loom.runner import ModelRunner, build_model

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="w4a8 runs on the kernels")


def _q4_k_m(v_type: int) -> Callable[[str, int], int]:
    """Q4_K_M's mix: Q6_K for v, down and the tied embedding, Q4_K elsewhere, up as Q5_K;
    attn_v in `v_type` (F16: a type the kernel does not compute)."""
    types = {"q": Q4_K, "k": Q4_K, "v": v_type, "o": Q4_K, "gate": Q4_K, "up": Q5_K,
             "down": Q6_K, "embedding": Q6_K}
    return lambda role, layer: types[role]


@pytest.fixture(scope="module")
def k_quant_llama(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("w4a8") / "tiny-q4km.gguf", _q4_k_m(Q6_K))


def _logits(config, model, prompt: list[int], step: int) -> torch.Tensor:
    """The last token's logits with the prompt computed in steps of `step` tokens."""
    runner = ModelRunner(config, model, "cpu", torch.float32, 64, 4)
    for start in range(0, len(prompt), step):
        part = prompt[start:start + step]
        row = runner.execute([chunk("s", part, start, len(prompt), seq=0)])
    return row[-1]


def test_every_matrix_and_the_embedding_come_from_the_files_blocks(
    k_quant_llama, tmp_path, monkeypatch,
) -> None:
    from loom.models.w4a8 import W4A8Embedding, W4A8Linear

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    _, model = build_model(k_quant_llama, quantization="w4a8")
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.types == [Q4_K, Q4_K, Q6_K]
    assert layer.mlp.gate_up_proj.types == [Q4_K, Q5_K]
    assert layer.mlp.down_proj.types == [Q6_K]
    assert isinstance(layer.self_attn.o_proj, W4A8Linear)
    embedding = model.model.embed_tokens
    assert isinstance(embedding, W4A8Embedding) and isinstance(model.lm_head, W4A8Linear)
    assert embedding.packed.data_ptr() == model.lm_head.packed_0.data_ptr()  # shared
    # The same weights as the exact float model of the file (q/k rows un-permuted alike).
    _, exact = build_model(k_quant_llama, quantization=None)
    stacked = exact.model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(layer.self_attn.qkv_proj.dequantized_weight(), stacked)
    ids = torch.tensor([0, 7, VOCAB - 1])
    assert torch.equal(embedding(ids), exact.model.embed_tokens(ids))


def test_logits_do_not_depend_on_the_steps_and_match_float(k_quant_llama, tmp_path,
                                                           monkeypatch) -> None:
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    prompt = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    config, model = build_model(k_quant_llama, quantization="w4a8")
    whole = _logits(config, model, prompt, 64)
    for step in (1, 5, 16):
        assert torch.equal(_logits(config, model, prompt, step), whole), step
    _, cached = build_model(k_quant_llama, quantization="w4a8")  # from the prepared cache
    assert torch.equal(_logits(config, cached, prompt, 64), whole)
    _, exact = build_model(k_quant_llama, quantization=None)
    ref = _logits(config, exact, prompt, 64)
    assert int(whole.argmax()) == int(ref.argmax())
    torch.testing.assert_close(whole, ref, atol=0.05 * float(ref.abs().max()), rtol=0)


def test_a_stack_with_a_part_the_kernel_cannot_compute_is_w8a8_of_the_files_values(
    tmp_path, monkeypatch,
) -> None:
    """q and k are Q4_K (their values are not decoded while loading: the kernel would compute
    them), v is F16: the q/k/v stack falls back to w8a8, over q and k decoded from their
    kept blocks: the same int8 weights as the w8a8 mode makes from the loaded values."""
    from loom.models.quant import Int8Linear
    from loom.models.w4a8 import W4A8Linear

    monkeypatch.setenv("LOOM_PREPARED_CACHE", "0")
    path = write_tiny_llama(tmp_path / "f16-v.gguf", _q4_k_m(F16))
    _, w4 = build_model(path, quantization="w4a8")
    _, w8 = build_model(path, quantization="w8a8")
    for a, b in zip(w4.model.layers, w8.model.layers, strict=True):
        assert isinstance(a.self_attn.qkv_proj, Int8Linear)
        assert torch.equal(a.self_attn.qkv_proj.weight_q, b.self_attn.qkv_proj.weight_q)
        assert torch.equal(a.self_attn.qkv_proj.scales, b.self_attn.qkv_proj.scales)
        assert isinstance(a.mlp.gate_up_proj, W4A8Linear)


def test_a_tensor_parallel_rank_keeps_only_its_part_of_the_blocks(k_quant_llama, tmp_path,
                                                                   monkeypatch) -> None:
    """Each of two ranks computes from its own rows of q/k/v, gate/up and the (tied) output
    projection, and from its own columns of down_proj, cut from the file's blocks: the same
    weights as the exact float model's slices, bit for bit. o_proj's half of 256 columns
    does not fall on a super-block boundary, so that rank computes its part of the values
    in w8a8 instead."""
    from loom.models.quant import Int8Linear
    from loom.models.w4a8 import W4A8Linear
    from loom.models.weight_shard import Shard

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    _, exact = build_model(k_quant_llama, quantization=None)
    full_layer = exact.model.layers[0]
    qkv = full_layer.self_attn.qkv_proj.weight
    q_rows, kv_rows = HIDDEN, KV_HEADS * HIDDEN // HEADS
    for rank in (0, 1):
        for warm in (False, True):  # built from the file, then from its prepared cache
            _, model = build_model(k_quant_llama, quantization="w4a8", shard=Shard(rank, 2))
            layer = model.model.layers[0]
            q = qkv[:q_rows][rank * q_rows // 2:(rank + 1) * q_rows // 2]
            k = qkv[q_rows:q_rows + kv_rows][rank * kv_rows // 2:(rank + 1) * kv_rows // 2]
            v = qkv[q_rows + kv_rows:][rank * kv_rows // 2:(rank + 1) * kv_rows // 2]
            assert torch.equal(layer.self_attn.qkv_proj.dequantized_weight(),
                               torch.cat([q, k, v])), (rank, warm)
            gate_up = full_layer.mlp.gate_up_proj.weight
            half = FFN // 2
            assert torch.equal(layer.mlp.gate_up_proj.dequantized_weight(), torch.cat([
                gate_up[:FFN][rank * half:(rank + 1) * half],
                gate_up[FFN:][rank * half:(rank + 1) * half]]))
            down = layer.mlp.down_proj
            assert isinstance(down, W4A8Linear) and torch.equal(
                down.dequantized_weight(),
                full_layer.mlp.down_proj.weight[:, rank * half:(rank + 1) * half])
            assert isinstance(layer.self_attn.o_proj, Int8Linear)  # 128 columns: values
            head = model.lm_head
            assert isinstance(head, W4A8Linear) and torch.equal(
                head.dequantized_weight(),
                exact.lm_head.weight[rank * VOCAB // 2:(rank + 1) * VOCAB // 2])
