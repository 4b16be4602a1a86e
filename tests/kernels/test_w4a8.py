"""The w4a8 kernel (GGUF blocks: the K-quants Q4_K / Q5_K / Q6_K and the blocks of 32 Q4_0 /
Q4_1 / Q5_0 / Q5_1 / Q8_0 / MXFP4, times int8 activations) against its plain-C oracle, on
every kernel variant this CPU runs: the same bits for any number of rows, any stacking of
segments, any position of a row in the call; the packed weights are the file's values bit for
bit; the result is the float product of the rounded activations and those weights, to float
rounding."""

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
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4 = 2, 3, 6, 7, 8, 12, 13, 14, 39
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, Q4_K: 144, Q5_K: 176,
               Q6_K: 210, MXFP4: 17}
BLOCK_VALUES = {t: 256 if t in (Q4_K, Q5_K, Q6_K) else 32 for t in BLOCK_BYTES}
# Where each type's float16 scales lie in a block (d, and dmin or m).
SCALE_AT = {Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q5_1: (0, 2), Q8_0: (0,), Q4_K: (0, 2),
            Q5_K: (0, 2), Q6_K: (208,)}


def random_blocks(type_id: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Valid file blocks: random integers and scales, small float16 scales (and signed m)."""
    rng = np.random.default_rng(seed)
    count = rows * cols // BLOCK_VALUES[type_id]
    blocks = rng.integers(0, 256, size=(count, BLOCK_BYTES[type_id]), dtype=np.uint8)
    if type_id == MXFP4:  # E8M0 scales 2^(e - 128) from 2^-128 (subnormal) to 2^-2
        blocks[:, 0] = rng.integers(0, 127, size=count, dtype=np.uint8)
        blocks[: min(count, 4), 0] = [0, 1, 2, 126][: min(count, 4)]
        return torch.from_numpy(blocks.reshape(rows, -1))
    for i, at in enumerate(SCALE_AT[type_id]):
        scales = rng.random(count, dtype=np.float32) * 2e-3 + 1e-4
        if i and type_id in (Q4_1, Q5_1):
            scales -= 1.1e-3  # m: a block's offset, of either sign
        blocks[:, at:at + 2] = scales.astype(np.float16).view(np.uint8).reshape(count, 2)
    return torch.from_numpy(blocks.reshape(rows, -1))


def file_values(raw: torch.Tensor, type_id: int, rows: int, cols: int) -> torch.Tensor:
    """What the `gguf` package (llama.cpp's arithmetic) dequantises the blocks to."""
    values = dequantize(raw.numpy(), GGMLQuantizationType(type_id))
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(rows, cols))


@pytest.mark.parametrize("type_id", sorted(BLOCK_BYTES))
def test_packing_keeps_the_files_values_bit_for_bit(type_id) -> None:
    # a partial last group of 8 columns; three super-blocks a row (or 20 blocks of 32: a
    # width no super-block divides, as Gemma 3 270M's 640)
    rows, cols = 37, 768 if BLOCK_VALUES[type_id] == 256 else 640
    raw = random_blocks(type_id, rows, cols, seed=type_id)
    packed = w4a8_pack(raw, type_id, rows, cols)
    assert torch.equal(w4a8_dequantize(packed, type_id, rows, cols),
                       file_values(raw, type_id, rows, cols))


@pytest.mark.parametrize("type_id", sorted(BLOCK_BYTES))
def test_records_keep_extreme_scales_exactly(type_id) -> None:
    """A record keeps its scales in 16 bits (float16 as the file, MXFP4's power of two as
    bfloat16): float16 subnormals, its largest value, infinities, and E8M0 from 2^-128 to
    2^126 and its top code come back as the file's values."""
    rows, cols = 9, BLOCK_VALUES[type_id] * 2
    raw = random_blocks(type_id, rows, cols, seed=40 + type_id)
    blocks = raw.numpy().reshape(-1, BLOCK_BYTES[type_id])
    if type_id == MXFP4:
        codes = [0, 1, 2, 3, 100, 126, 127, 200, 253, 254, 255]
        blocks[:len(codes), 0] = codes
    else:
        specials = np.array([0x0001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x8001, 0x7C00, 0xFC00,
                             0x0000, 0x8000], dtype=np.uint16)
        for at in SCALE_AT[type_id]:
            picked = specials[np.arange(blocks.shape[0]) % len(specials)]
            blocks[:, at:at + 2] = picked.view(np.uint8).reshape(-1, 2)
    packed = w4a8_pack(raw, type_id, rows, cols)
    with np.errstate(all="ignore"):  # infinities times zero: NaN, as in the file's values
        want = file_values(raw, type_id, rows, cols)
    torch.testing.assert_close(w4a8_dequantize(packed, type_id, rows, cols), want, rtol=0,
                               atol=0, equal_nan=True)


def test_the_record_sizes_python_states_are_the_kernels() -> None:
    from loom.kernels import W4A8_TYPES, load_library

    lib = load_library()
    for type_id, (record_bytes, _) in W4A8_TYPES.items():
        assert lib.loom_w4a8_record_bytes(type_id) == record_bytes, type_id
    assert lib.loom_w4a8_record_bytes(10) == -1  # Q2_K: not packed
    # no record is wider than the file's blocks need beyond its 16-bit scales and Q4_K's
    # bytes of sc and m (Q5_0 / Q5_1 keep one byte a value)
    for type_id, extra in {Q4_0: 0, Q4_1: 0, Q8_0: 0, MXFP4: 1, Q6_K: 0, Q4_K: 4}.items():
        per_column = W4A8_TYPES[type_id][0] // 8
        assert per_column == BLOCK_BYTES[type_id] + extra, type_id


# Stacks of segments of mixed types, as files mix them within a layer (Q4_K_M: Q4_K and
# Q6_K; their fallbacks: Q5_0 and Q8_0; older files: Q4_0, Q4_1, Q5_1). At most 4 a layer.
STACKS = {
    "k-quants": [(Q4_K, 40), (Q6_K, 19), (Q5_K, 19), (Q4_K, 8)],
    "blocks-of-32": [(Q5_0, 40), (Q8_0, 19), (Q4_1, 11), (Q4_0, 16)],
    "mixed": [(Q5_1, 13), (Q4_K, 24), (Q8_0, 8), (Q6_K, 9)],
    "mxfp4": [(MXFP4, 40), (Q8_0, 19), (MXFP4, 11), (Q5_0, 16)],  # gpt-oss's experts
}


def _stack(name: str) -> tuple[list[tuple[int, torch.Tensor, int]], torch.Tensor,
                               torch.Tensor]:
    """A stack's packed segments, their float weight and a bias."""
    k = 512
    segments, weights = [], []
    for i, (type_id, cols) in enumerate(STACKS[name]):
        raw = random_blocks(type_id, cols, k, seed=10 + i)
        segments.append((type_id, w4a8_pack(raw, type_id, cols, k), cols))
        weights.append(file_values(raw, type_id, cols, k))
    n = sum(cols for _, cols in STACKS[name])
    return segments, torch.cat(weights), torch.randn(n, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module", params=sorted(STACKS))
def stacked(request) -> tuple[list[tuple[int, torch.Tensor, int]], torch.Tensor, torch.Tensor]:
    return _stack(request.param)


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


@pytest.mark.parametrize("type_id", [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4])
def test_blocks_of_32_on_a_width_no_super_block_divides(type_id) -> None:
    """Gemma 3 270M's q/k/v and gate/up: 640 inputs in Q5_0 (its v in Q8_0)."""
    k, cols = 640, 21
    raw = random_blocks(type_id, cols, k, seed=type_id)
    segments = [(type_id, w4a8_pack(raw, type_id, cols, k), cols)]
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(type_id))
    for variant in runnable_variants():
        with use_variant(variant):
            assert torch.equal(linear_w4a8(x, segments, None),
                               linear_w4a8(x, segments, None, reference=True))
    want = round_activations_q8(x).double() @ file_values(raw, type_id, cols, k).double().T
    got = linear_w4a8(x, segments, None)
    torch.testing.assert_close(got.double(), want, atol=1e-4 * float(want.abs().max()), rtol=0)


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
    with pytest.raises(ValueError, match="multiple of their block"):
        w4a8_pack(raw, Q4_K, 8, 200)
    with pytest.raises(ValueError, match="GGUF types"):
        w4a8_pack(raw, 10, 8, 256)  # Q2_K
    with pytest.raises(ValueError, match="not type 12"):  # a Q4_K segment 320 wide
        linear_w4a8(torch.zeros(1, 320), [(Q4_K, w4a8_pack(raw, Q4_K, 8, 256), 8)], None)
    packed = w4a8_pack(raw, Q4_K, 8, 256)
    with pytest.raises(ValueError, match="not type 12"):
        linear_w4a8(torch.zeros(1, 512), [(Q4_K, packed, 8)], None)
