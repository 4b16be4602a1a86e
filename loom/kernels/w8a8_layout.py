"""The weight layout Loom's w8a8 kernel reads (`w8a8_body` in cpu/w8a8.c).

Output columns in groups of PACKED_COLUMNS, each group's K in steps of 4, stored as unsigned
bytes w + 128: one 32-byte load holds 4 consecutive k of 8 columns, and a group is one
sequential stream. The kernel owns this layout; `loom.models.quant.Int8Linear` stores its
w8a8 weights in it.
"""

from __future__ import annotations

import torch

# Output columns per group of the packed layout (one vector of int32 sums in the kernel).
PACKED_COLUMNS = 8


# Bytes of weights `to_packed_layout` rearranges at a time (its temporaries stay this size).
_PACK_SLICE = 1 << 24
# The top bit of each byte of a 32-bit word, as a signed int32.
_TOP_BITS = -0x7F7F7F80


def to_packed_layout(w_int8: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 -> the w8a8 kernel's layout: uint8 [ceil(N/8), K/4, 8, 4] holding w + 128,
    columns in groups of 8, each group's K in steps of 4 (the last group padded with zero
    weights). See `w8a8_body` in cpu/w8a8.c. Converted a slice of groups at a time."""
    n, k = w_int8.shape
    groups = -(-n // PACKED_COLUMNS)
    packed = torch.empty((groups, k // 4, PACKED_COLUMNS, 4), dtype=torch.uint8)
    source = w_int8.contiguous().view(torch.uint8)
    if n % PACKED_COLUMNS:  # the last group's missing columns: zero weights
        rows = torch.zeros((PACKED_COLUMNS, k), dtype=torch.uint8)
        rows[: n % PACKED_COLUMNS] = source[(groups - 1) * PACKED_COLUMNS :]
        source = torch.cat([source[: (groups - 1) * PACKED_COLUMNS], rows])
    step = max(1, _PACK_SLICE // (PACKED_COLUMNS * k))
    for first in range(0, groups, step):
        count = min(step, groups - first)
        # Each run of 4 consecutive k is moved as one 32-bit word.
        rows = source[first * PACKED_COLUMNS : (first + count) * PACKED_COLUMNS].view(torch.int32)
        part = packed[first : first + count].view(count, k // 4, PACKED_COLUMNS * 4)
        part = part.view(torch.int32)
        part.copy_(rows.view(count, PACKED_COLUMNS, k // 4).permute(0, 2, 1))
        # w + 128 as an unsigned byte is the two's-complement byte with its top bit flipped.
        part.bitwise_xor_(_TOP_BITS)
    return packed


def from_packed_layout(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `to_packed_layout`: the row-major int8 weight [N, K]."""
    groups, steps = packed.shape[:2]
    rows = (packed.to(torch.int16) - 128).permute(0, 2, 1, 3).reshape(groups * PACKED_COLUMNS,
                                                                      steps * 4)
    return rows[:n].to(torch.int8).contiguous()
