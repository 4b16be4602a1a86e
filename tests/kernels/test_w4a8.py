"""The w4a8 kernel (GGUF Q4_K / Q5_K / Q6_K blocks x int8 activations) against its plain-C oracle,
on every kernel variant this CPU runs: the same bits for any number of rows, any stacking of
segments, any position of a row in the call; the packed weights are the file's values bit
for bit; the result is the float product of the rounded activations and those weights, to
float rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from loom.kernels import (
    cpu_kernels_available,
    linear_w4a8,
    w4a8_dequantize,
    w4a8_pack,
)
from loom.kernels.build import runnable_variants, use_variant
from loom.models.quant import round_activations_q8

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no CPU kernels here")
Q4_K, Q5_K, Q6_K = 12, 13, 14
BLOCK_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210}


def random_blocks(type_id: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Valid file blocks: random integers and scales, small float16 super-block scales."""
    rng = np.random.default_rng(seed)
    count = rows * cols // 256
    blocks = rng.integers(0, 256, size=(count, BLOCK_BYTES[type_id]), dtype=np.uint8)
    for at in ((208,) if type_id == Q6_K else (0, 2)):
        scales = (rng.random(count, dtype=np.float32) * 2e-3 + 1e-4).astype(np.float16)
        blocks[:, at:at + 2] = scales.view(np.uint8).reshape(count, 2)
    return torch.from_numpy(blocks.reshape(rows, -1))


def file_values(raw: torch.Tensor, type_id: int, rows: int, cols: int) -> torch.Tensor:
    """What the `gguf` package (llama.cpp's arithmetic) dequantises the blocks to."""
    values = dequantize(raw.numpy(), GGMLQuantizationType(type_id))
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(rows, cols))


@pytest.mark.parametrize("type_id", [Q4_K, Q5_K, Q6_K])
def test_packing_keeps_the_files_values_bit_for_bit(type_id) -> None:
    rows, cols = 37, 768  # a partial last group of 8 columns; three super-blocks a row
    raw = random_blocks(type_id, rows, cols, seed=type_id)
    packed = w4a8_pack(raw, type_id, rows, cols)
    assert torch.equal(w4a8_dequantize(packed, type_id, rows, cols),
                       file_values(raw, type_id, rows, cols))


@pytest.fixture(scope="module")
def stacked() -> tuple[list[tuple[int, torch.Tensor, int]], torch.Tensor, torch.Tensor]:
    """q/k/v-like segments of mixed types (as a Q4_K_M file's layers mix them), their float
    weight and a bias."""
    k = 512
    segments, weights = [], []
    for i, (type_id, cols) in enumerate([(Q4_K, 40), (Q6_K, 19), (Q5_K, 19), (Q4_K, 8)]):
        raw = random_blocks(type_id, cols, k, seed=10 + i)
        segments.append((type_id, w4a8_pack(raw, type_id, cols, k), cols))
        weights.append(file_values(raw, type_id, cols, k))
    bias = torch.randn(86, generator=torch.Generator().manual_seed(3))
    return segments, torch.cat(weights), bias


@pytest.mark.parametrize("variant", runnable_variants())
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 9, 13])
def test_every_variant_computes_the_oracles_bits(stacked, variant, rows) -> None:
    segments, _, bias = stacked
    x = 3 * torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0.0  # an all-zero block (scale 0)
    with use_variant(variant):
        got = linear_w4a8(x, segments, bias)
        want = linear_w4a8(x, segments, bias, reference=True)
    assert torch.equal(got, want)


def test_a_rows_result_does_not_depend_on_the_call(stacked) -> None:
    segments, _, bias = stacked
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(5))
    together = linear_w4a8(x, segments, bias)
    for i in range(9):
        alone = linear_w4a8(x[i:i + 1].contiguous(), segments, bias)
        assert torch.equal(alone[0], together[i])
    pair = linear_w4a8(x[3:5].contiguous(), segments, bias)
    assert torch.equal(pair, together[3:5])


def test_the_result_is_the_rounded_activations_times_the_files_weights(stacked) -> None:
    segments, weight, bias = stacked
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(6))
    got = linear_w4a8(x, segments, bias)
    want = round_activations_q8(x.double().float()).double() @ weight.double().T + bias.double()
    torch.testing.assert_close(got.double(), want, atol=1e-4 * float(want.abs().max()), rtol=0)


def test_bad_shapes_are_named() -> None:
    raw = random_blocks(Q4_K, 8, 256, seed=1)
    with pytest.raises(ValueError, match="k % 256"):
        w4a8_pack(raw, Q4_K, 8, 200)
    with pytest.raises(ValueError, match="GGUF types"):
        w4a8_pack(raw, 8, 8, 256)
    packed = w4a8_pack(raw, Q4_K, 8, 256)
    with pytest.raises(ValueError, match="not type 12"):
        linear_w4a8(torch.zeros(1, 512), [(Q4_K, packed, 8)], None)
