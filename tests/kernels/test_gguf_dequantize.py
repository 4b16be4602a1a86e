"""GGUF block types decoded by Loom's C kernels equal the `gguf` package's dequantisers bit
for bit (the float32 operations in the same order), for every type the kernels decode, on
random blocks (every bit pattern of the quantised values and packed scales, finite float16
scales) and on row counts and shapes of real files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom.kernels import GGUF_C_BLOCK_TYPES, cpu_kernels_available, dequantize_gguf_blocks

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no CPU kernels here")

# Byte offsets of each block type's float16 fields (the rest is any byte at all: MXFP4's
# E8M0 scale byte takes every value, subnormal and overflowing scales included).
_F16_FIELDS = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 12: [0, 2], 13: [0, 2],
               14: [208], 39: []}


def _random_blocks(type_id: int, blocks: int, seed: int) -> np.ndarray:
    block_bytes, _ = GGUF_C_BLOCK_TYPES[type_id]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(blocks, block_bytes), dtype=np.uint8)
    for at in _F16_FIELDS[type_id]:  # finite scales of every magnitude and sign, zero too
        scales = (rng.standard_normal(blocks) * 10.0 ** rng.integers(-6, 3, blocks))
        scales[::7] = 0.0
        raw[:, at:at + 2] = scales.astype(np.float16).view(np.uint8).reshape(blocks, 2)
    return raw


@pytest.mark.parametrize("type_id", sorted(GGUF_C_BLOCK_TYPES))
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_c_dequantisation_equals_gguf_bit_for_bit(type_id: int, rows: int) -> None:
    qtype = gguf.GGMLQuantizationType(type_id)
    block_bytes, block_values = GGUF_C_BLOCK_TYPES[type_id]
    per_row = 3  # blocks per row: 96 or 768 values
    raw = _random_blocks(type_id, rows * per_row, seed=type_id * 100 + rows)
    raw = raw.reshape(rows, per_row * block_bytes)
    expected = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)
    out = torch.empty(rows, per_row * block_values)
    assert dequantize_gguf_blocks(raw, type_id, out)
    assert np.array_equal(out.numpy().view(np.int32), expected.reshape(out.shape).view(np.int32))


def test_unknown_types_and_bad_shapes() -> None:
    raw = np.zeros((2, 34), dtype=np.uint8)
    assert not dequantize_gguf_blocks(raw, 10, torch.empty(2, 32))  # Q2_K: not decoded here
    with pytest.raises(ValueError, match="2 blocks hold 64 values"):
        dequantize_gguf_blocks(raw, 8, torch.empty(3, 32))
    with pytest.raises(ValueError, match="whole contiguous blocks"):
        dequantize_gguf_blocks(np.zeros(35, dtype=np.uint8), 8, torch.empty(32))


def test_the_default_model_loads_the_same_with_and_without_the_c_path(gemma_path, monkeypatch):
    """Every tensor of the real Q4_K_M file (Q4_K, Q5_0, Q6_K, Q8_0 and F32) comes out of
    the loader with the same bits either way."""
    from loom.loader import gguf_file
    from loom.loader.gguf_reader import GGUFFile

    reader = GGUFFile(gemma_path)
    config = gguf_file.gguf_to_hf_config(reader)
    fast = dict(gguf_file.iter_gguf_weights(reader, config))
    monkeypatch.setattr(gguf_file, "dequantize_gguf_blocks", lambda *args: False)
    slow = dict(gguf_file.iter_gguf_weights(GGUFFile(gemma_path), config))
    assert fast.keys() == slow.keys()
    kinds = {t.qtype.name for t in reader.tensors}
    assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0"} <= kinds, kinds
    for name, tensor in fast.items():
        assert torch.equal(tensor.view(torch.int32), slow[name].view(torch.int32)), name
