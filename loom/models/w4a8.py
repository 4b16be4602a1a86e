"""w4a8: linear layers computed from a GGUF file's own quantised blocks, int8 activations.

A Q4_K_M file stores most matrices as Q4_K (4.5 bits a weight) and some as Q6_K (6.6 bits);
a Q5_K_M file most as Q5_K (5.5 bits); where a matrix's rows are not whole super-blocks of
256, both fall back to blocks of 32 (Q5_0, Q8_0: Gemma 3 270M's 640-wide projections), and
older files are Q4_0, Q4_1 or Q8_0 throughout.
The w8a8 mode dequantises them and quantises again to 8 bits per weight, so decode reads
almost twice a Q4_K file's bytes. Here a layer keeps the file's integers and scales, repacked
once for the kernel (`loom.kernels.w4a8_pack`: groups of 8 output columns, the scales in
16 bits as the file holds them; 4.625 bits a weight for Q4_K, 4.5 for Q4_0 and MXFP4, 5 for
Q4_1, 6.56 for Q6_K (the file's own), 8.5-9 for Q5_K, Q5_0, Q5_1 and Q8_0, whose values are
kept one byte each), and every
call, a decode row or a prefill chunk of thousands, runs one arithmetic
(`loom_linear_w4a8` in kernels/cpu/w4a8_kquants.c): activations rounded to int8 per
block of 32 as w8a8 rounds them, each block's products summed exactly in integers, the
float scaling in one fixed order. A row's result is the same bits in any
batch, chunk or kernel variant; the weights are the file's (no second quantisation).

Stacked projections (q/k/v, gate/up) become one layer of several segments, each in its own
file type (a Q4_K_M file mixes Q4_K and Q6_K within a layer). A layer whose parts the kernel
cannot compute (another block type, an input width not a multiple of the type's block) is
left to the w8a8 preparation by the caller (`W4A8Linear.from_linears` returns None).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from loom.kernels import (
    W4A8_TYPES,
    linear_w4a8,
    use_cpu_kernels,
    w4a8_dequantize,
    w4a8_pack,
    w4a8_packed_shape,
    w4a8_record_k,
    w4a8_rows,
)
from loom.kernels.cpu_ops import GGUF_C_BLOCK_TYPES
from loom.models.layers import stacked_bias
from loom.models.quant import round_activations_q8
from loom.models.weight_shard import ShardRule

# The attribute of an nn.Linear (or the embedding of a tied model) that holds its tensor's
# file blocks while the model loads (set by the loader's `keep_blocks` hook).
BLOCKS_ATTRIBUTE = "gguf_blocks"


class GGUFBlocks(NamedTuple):
    """A 2-D tensor's data as the file stores it: uint8 [rows, bytes per row]."""

    type_id: int
    raw: torch.Tensor


def shard_blocks(raw: torch.Tensor, type_id: int, rule: ShardRule) -> torch.Tensor | None:
    """A tensor-parallel rank's part of a tensor's file blocks (uint8 [rows, bytes per
    row]): rows [start, stop) (zero blocks past the end: zero weights), or columns
    [start, stop) where both fall on block (or super-block) boundaries; None where the part does not
    split the blocks (the rank then computes from its part of the values)."""
    if rule.first_rank_only:
        return None
    if rule.dim == 0:
        start, stop = rule.span(raw.shape[0])
        return rule.pad(raw[start:stop])
    block_bytes, block_values = GGUF_C_BLOCK_TYPES[type_id]  # a record's k, for w4a8 types
    if rule.start % block_values or rule.stop % block_values:
        return None
    return raw[:, rule.start // block_values * block_bytes:
               rule.stop // block_values * block_bytes].contiguous()


def computable(blocks: GGUFBlocks | int | None, in_features: int) -> bool:
    """Whether the w4a8 kernel computes a tensor of `in_features` columns stored as `blocks`
    (or in the GGUF type of that id)."""
    type_id = blocks.type_id if isinstance(blocks, GGUFBlocks) else blocks
    return type_id in W4A8_TYPES and in_features % w4a8_record_k(type_id) == 0


class W4A8Linear(nn.Module):
    """y = x @ W.T + bias, W the file's K-quant blocks of each segment, stacked along the
    outputs. Buffers: `packed_<i>` per segment, `bias` (float32) or None."""

    def __init__(self, in_features: int, parts: list[tuple[int, int]],
                 bias: torch.Tensor | None = None,
                 packed: list[torch.Tensor] | None = None) -> None:
        """`parts`: (GGUF type id, columns) per segment; `packed`: their packed weights
        (None: shapes only, on the meta device, for a structure loaded from elsewhere)."""
        super().__init__()
        self.in_features = in_features
        self.types = [t for t, _ in parts]
        self.columns = [c for _, c in parts]
        self.out_features = sum(self.columns)
        for i, (type_id, cols) in enumerate(parts):
            shape = w4a8_packed_shape(type_id, cols, in_features)
            tensor = packed[i] if packed is not None else torch.empty(
                shape, dtype=torch.uint8, device="meta")
            if tuple(tensor.shape) != shape:
                raise ValueError(f"segment {i}: packed shape {tuple(tensor.shape)} != {shape}")
            self.register_buffer(f"packed_{i}", tensor)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_linears(cls, linears: list[nn.Module]) -> W4A8Linear | None:
        """One layer computing the concatenated outputs of `linears` from their file blocks
        (each holds them under BLOCKS_ATTRIBUTE), or None when the kernel cannot compute
        every part."""
        k = linears[0].in_features
        blocks = [getattr(lin, BLOCKS_ATTRIBUTE, None) for lin in linears]
        if not all(computable(b, k) for b in blocks):
            return None
        parts = [(b.type_id, lin.out_features) for lin, b in zip(linears, blocks, strict=True)]
        if any(b.raw.is_meta for b in blocks):  # a prepared model's structure: shapes only
            bias = stacked_bias(linears)
            return cls(k, parts, None if bias is None else torch.empty_like(bias, device="meta"))
        packed = [w4a8_pack(b.raw, b.type_id, lin.out_features, k)
                  for lin, b in zip(linears, blocks, strict=True)]
        return cls(k, parts, stacked_bias(linears), packed)

    def segments(self) -> list[tuple[int, torch.Tensor, int]]:
        """(type id, packed weight, columns) per segment, as `linear_w4a8` takes them."""
        return [(t, getattr(self, f"packed_{i}"), c)
                for i, (t, c) in enumerate(zip(self.types, self.columns, strict=True))]

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight [out, in] this layer computes with: the file's dequantised
        values, bit for bit."""
        return torch.cat([w4a8_dequantize(p, t, c, self.in_features)
                          for t, p, c in self.segments()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer to x [..., K] -> [..., N] in x's dtype."""
        lead = x.shape[:-1]
        rows = x.numel() // self.in_features
        x2 = x.reshape(rows, self.in_features)
        if use_cpu_kernels(x):
            y = linear_w4a8(x2.contiguous(), self.segments(), self.bias)
        else:  # the same model to float rounding: rounded activations, dequantised weights
            xf = round_activations_q8(x2.float())
            y = F.linear(xf, self.dequantized_weight(), self.bias).to(x.dtype)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{GGMLQuantizationType(t).name}x{c}"
                          for t, c in zip(self.types, self.columns, strict=True))
        return f"in_features={self.in_features}, segments=[{kinds}]"


class W4A8Embedding(nn.Module):
    """The token embedding kept as the file's packed K-quant blocks: a lookup dequantises its
    rows (the file's values, bit for bit). A float32 copy of a 128k x 4096 table is 2 GB; a
    tied model's table shares its blocks with the output projection."""

    def __init__(self, num_embeddings: int, embedding_dim: int, type_id: int,
                 packed: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.type_id = (
            num_embeddings, embedding_dim, type_id)
        self.register_buffer("packed", packed if packed is not None else torch.empty(
            w4a8_packed_shape(type_id, num_embeddings, embedding_dim), dtype=torch.uint8,
            device="meta"))

    @classmethod
    def from_embedding(cls, embedding: nn.Module,
                       head: W4A8Linear | None = None) -> W4A8Embedding | None:
        """From the file blocks the embedding holds (sharing `head`'s packed weight when the
        output projection was made from the same blocks), or None where the kernel does not
        read them."""
        blocks = getattr(embedding, BLOCKS_ATTRIBUTE, None)
        rows, dim = embedding.weight.shape
        if blocks is None or not computable(blocks, dim):
            return None
        if blocks.raw.is_meta:
            return cls(rows, dim, blocks.type_id)
        if head is not None and head.types == [blocks.type_id] and head.out_features == rows:
            return cls(rows, dim, blocks.type_id, head.packed_0)
        return cls(rows, dim, blocks.type_id, w4a8_pack(blocks.raw, blocks.type_id, rows, dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the table for `input_ids` [...] -> float32 [..., D]."""
        return w4a8_rows(self.packed, self.type_id, self.num_embeddings, self.embedding_dim,
                         input_ids.cpu()).to(input_ids.device)
