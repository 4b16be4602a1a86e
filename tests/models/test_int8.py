"""Weight-only int8: layers stay close to float32, rows are batch invariant, greedy mostly equal."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TinyModel, chunk

from loom.kernels import cpu_kernels_available
from loom.models.layers import LARGE_BATCH_ROWS, Linear
from loom.models.quant import (
    DEQUANTIZE_MIN_ROWS,
    KERNEL_MAX_ROWS,
    Int8Linear,
    quantize_weight_int8,
    set_large_batch_dtype,
)
from loom.runner import ModelRunner, build_model

# The kernel paths run on every CPU kernel variant this host executes.
pytestmark = pytest.mark.usefixtures("each_kernel_variant")


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def test_quantize_weight_round_trip_error_is_half_a_step() -> None:
    w = torch.randn(64, 96)
    w_int8, scales = quantize_weight_int8(w)
    assert w_int8.dtype == torch.int8 and scales.dtype == torch.bfloat16
    err = (w_int8.float() * scales.float()[:, None] - w).abs()
    assert bool((err <= scales.float()[:, None] * 0.51).all())


def test_int8_linear_close_and_batch_invariant() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 48, bias=True)
    q = Int8Linear(lin.weight, lin.bias)
    x = torch.randn(7, 96)
    y = q(x)
    ref = torch.nn.functional.linear(x, q.dequantized_weight(), lin.bias)
    torch.testing.assert_close(y, ref, atol=0.05, rtol=0.02)
    # A row's result does not depend on the other rows of the call.
    assert torch.equal(q(x[2:3]), y[2:3])


def test_int8_prefill_path_agrees_with_kernel_path() -> None:
    torch.manual_seed(1)
    lin = torch.nn.Linear(96, 48, bias=False)
    q = Int8Linear(lin.weight, None)
    x = torch.randn(max(DEQUANTIZE_MIN_ROWS, KERNEL_MAX_ROWS) + 8, 96)
    many = q(x)  # dequantised float matmul
    rows = torch.cat([q(x[i : i + 1]) for i in range(x.shape[0])])  # int8 kernel, row by row
    # The kernel returns bfloat16 sums; the float path keeps float32 ones: bf16 rounding apart.
    torch.testing.assert_close(many, rows, atol=1e-2, rtol=8e-3)


def _int8_runner(tiny_model: TinyModel, mode: str = "int8") -> ModelRunner:
    config, model = build_model(tiny_model.path, torch.float32, quantization=mode)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    return ModelRunner(config, model, "cpu", torch.float32, 64, 4)


def _prefill_then_decode(runner: ModelRunner, tokens: list[int], split: int) -> torch.Tensor:
    """Logits of a one-chunk prefill of tokens[:split], then of each decode step after it."""
    total = len(tokens)
    out = [runner.execute([chunk("a", tokens[:split], 0, total, seq=0)])]
    for p in range(split, total):
        out.append(runner.execute([chunk("a", [tokens[p]], p, total, seq=0)]))
    return torch.cat(out)


@pytest.mark.parametrize("mode", ["int8", "w8a8"])
def test_int8_logits_close_to_float32(tiny_model: TinyModel, mode: str) -> None:
    """Prefill + decode logits of the int8 model stay near float32's; argmax mostly equal."""
    tokens = _prompt(24, 3, tiny_model.loom_config.vocab_size)
    ref = _prefill_then_decode(tiny_model.runner(), tokens, 16)
    got = _prefill_then_decode(_int8_runner(tiny_model, mode), tokens, 16)
    assert float((got - ref).abs().max()) < 0.05 * float(ref.abs().max())
    agree = int((got.argmax(-1) == ref.argmax(-1)).sum())
    assert agree >= ref.shape[0] - 2, f"{tiny_model.name}: argmax agrees on {agree}/{ref.shape[0]}"


def test_int8_embedding_lookup_stays_exact(tiny_model: TinyModel) -> None:
    """A tied output projection is quantised on its own copy; the embedding keeps float32."""
    _, model = build_model(tiny_model.path, torch.float32, quantization="int8")
    ref = tiny_model.loom_model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, ref)
    assert isinstance(model.lm_head, Int8Linear)


def test_w8a8_rounds_activations_only_in_the_kernel() -> None:
    """w8a8 differs from int8 by activation rounding alone: close, and not bit-identical."""
    torch.manual_seed(2)
    lin = torch.nn.Linear(64, 40, bias=True)
    exact, rounded = Int8Linear(lin.weight, lin.bias), Int8Linear(lin.weight, lin.bias, True)
    assert rounded.quantize_activations
    x = torch.randn(3, 64)
    with torch.inference_mode():  # the CPU kernels run only when no gradient is recorded
        torch.testing.assert_close(rounded(x), exact(x), atol=0.02, rtol=0.02)
        if cpu_kernels_available():
            assert not torch.equal(rounded(x), exact(x))
    assert not Int8Linear(torch.randn(8, 40), None, True).quantize_activations  # K % 32 != 0


def test_large_batches_multiply_in_bf16_when_asked_and_stay_close() -> None:
    """`set_large_batch_dtype(bfloat16)` (hosts with native bf16): calls of many rows
    multiply in bf16 with the same weights and activation rounding; small calls keep the
    kernels. The result stays within bf16 rounding of the float32 path."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(256, 96, bias=True)
    layer = Int8Linear(lin.weight, lin.bias, True)
    x = torch.randn(KERNEL_MAX_ROWS + 16, 256)
    with torch.inference_mode():
        float_path = layer(x)
        small = layer(x[:3])
        model = torch.nn.Sequential(layer)
        set_large_batch_dtype(model, torch.bfloat16)
        bf16_path = layer(x)
        assert bf16_path.dtype == torch.float32
        assert not torch.equal(bf16_path, float_path)  # it did multiply in bf16
        scale = float_path.abs().max()
        torch.testing.assert_close(bf16_path, float_path, atol=float(scale) * 2**-7, rtol=0)
        assert torch.equal(layer(x[:3]), small)  # decode-sized calls are unchanged


def test_float_layers_multiply_large_batches_in_bf16_from_a_kept_copy() -> None:
    """Float checkpoints on native-bf16 hosts: float32 weights for decode (the kernels), a
    bf16 copy (not saved with the state) for calls of many rows."""
    torch.manual_seed(4)
    layer = Linear(128, 64, bias=True)
    x = torch.randn(LARGE_BATCH_ROWS + 5, 128)
    with torch.inference_mode():
        float_path, small = layer(x), layer(x[:2])
        set_large_batch_dtype(torch.nn.Sequential(layer), torch.bfloat16)
        assert layer.weight_large_batch.dtype == torch.bfloat16
        assert "weight_large_batch" not in layer.state_dict()
        bf16_path = layer(x)
        assert bf16_path.dtype == torch.float32 and not torch.equal(bf16_path, float_path)
        scale = float(float_path.abs().max())
        torch.testing.assert_close(bf16_path, float_path, atol=scale * 2**-7, rtol=0)
        assert torch.equal(layer(x[:2]), small)  # decode-sized calls are unchanged
