"""Loom's C kernels against plain torch, and the fallback when they are switched off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from loom.kernels import (
    cpu_kernels_available,
    kernel_status,
    linear_f32,
    linear_w8,
    paged_attention,
    rms_norm,
    rope_neox,
)

pytestmark = [
    pytest.mark.skipif(
        not cpu_kernels_available(), reason=f"CPU kernels unavailable: {kernel_status()}"
    ),
    pytest.mark.usefixtures("each_kernel_variant"),
]


@pytest.mark.parametrize(("n", "k"), [(1000, 640), (1003, 600), (7, 2048), (64, 1100), (3, 16)])
@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_linear_w8_matches_dequantised_matmul(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) * 0.01
    bias = torch.randn(n, generator=g)
    y = linear_w8(x, w, scale, bias)
    ref = x.double() @ (w.double() * scale.double()[:, None]).T + bias.double()
    torch.testing.assert_close(y.double(), ref, atol=2e-4, rtol=1e-5)
    no_bias = linear_w8(x, w, scale, None)
    torch.testing.assert_close(no_bias, y - bias, atol=1e-5, rtol=1e-5)


def test_linear_w8_rows_are_batch_invariant() -> None:
    """A row's result is bit-identical whatever else is in the call (m = 1 or m > 1 paths)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 1100, generator=g)
    w = torch.randint(-127, 128, (70, 1100), dtype=torch.int8, generator=g)
    scale = torch.rand(70, generator=g)
    y = linear_w8(x, w, scale, None)
    for i in range(x.shape[0]):
        assert torch.equal(linear_w8(x[i : i + 1].contiguous(), w, scale, None), y[i : i + 1])
    assert torch.equal(linear_w8(x[3:7].contiguous(), w, scale, None), y[3:7])


def test_linear_w8_rejects_wrong_dtypes_and_shapes() -> None:
    w = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"x: need a contiguous torch\.float32"):
        linear_w8(torch.zeros(1, 8, dtype=torch.float64), w, torch.ones(4), None)
    with pytest.raises(ValueError, match="do not match"):
        linear_w8(torch.zeros(1, 9), w, torch.ones(4), None)


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_paged_decode_attention_matches_dense(window: int | None, softcap: float | None) -> None:
    """Three sequences with scattered blocks, GQA 4:2, against attention over gathered keys."""
    g = torch.Generator().manual_seed(3)
    block, heads, kv_heads, dim = 4, 4, 2, 16
    cache = torch.randn(2, 12, block, kv_heads, dim, generator=g)
    tables = torch.tensor([[7, 2, 9, 4], [0, 11, 0, 0], [5, 3, 10, 1]])
    seq_lens = torch.tensor([15, 6, 16])
    q = torch.randn(3, heads, dim, generator=g)
    starts = torch.arange(4)  # one query per sequence
    out = paged_attention(q, starts, cache, tables, seq_lens, 16, 0.25, window, softcap)
    for i, length in enumerate(seq_lens.tolist()):
        keys = cache[0][tables[i]].reshape(-1, kv_heads, dim)[:length]
        vals = cache[1][tables[i]].reshape(-1, kv_heads, dim)[:length]
        keys = keys.repeat_interleave(2, dim=1)
        vals = vals.repeat_interleave(2, dim=1)
        scores = torch.einsum("hd,khd->hk", q[i], keys) * 0.25
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if window:
            scores[:, : max(0, length - window)] = float("-inf")
        ref = torch.einsum("hk,khd->hd", scores.softmax(-1), vals)
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)


def test_switch_off_falls_back_to_torch_paths() -> None:
    """LOOM_CPU_KERNELS=0: the kernels report why, "auto" picks the torch attention backend."""
    code = (
        "from loom.kernels import kernel_status\n"
        "from loom.attention import get_attention_backend\n"
        "print(kernel_status(), get_attention_backend('auto', 'cpu').name)\n"
    )
    env = {**os.environ, "LOOM_CPU_KERNELS": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "disabled by LOOM_CPU_KERNELS=0 torch"


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(offset: float, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 17, 100, generator=g) * 4
    w = torch.randn(100, generator=g)
    res = torch.randn(3, 17, 100, generator=g) if with_residual else None
    out = rms_norm(x, w, 1e-6, offset, res)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (w + offset)
    if res is not None:
        ref = ref + res
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_rope_neox_matches_rotate_half() -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 3, 8, generator=g)
    angles = torch.randn(5, 4, generator=g)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    rotated = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    ref = x * cos[:, None] + rotated * sin[:, None]
    torch.testing.assert_close(rope_neox(x, cos, sin), ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 37, 100), (5, 64, 640), (16, 9, 2048)])
def test_linear_f32_matches_matmul_and_is_batch_invariant(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n)
    y = linear_f32(x, w, b)
    torch.testing.assert_close(y, x @ w.T + b, atol=1e-4, rtol=1e-5)
    for i in range(m):
        assert torch.equal(linear_f32(x[i : i + 1].contiguous(), w, b), y[i : i + 1])


def test_packed_layout_round_trips_and_pads_the_last_column_group() -> None:
    from loom.kernels.w8a8_layout import from_packed_layout, to_packed_layout

    g = torch.Generator().manual_seed(9)
    w = torch.randint(-127, 128, (61, 96), dtype=torch.int8, generator=g)
    packed = to_packed_layout(w)
    assert packed.shape == (8, 24, 8, 4) and packed.dtype == torch.uint8
    assert torch.equal(from_packed_layout(packed, 61), w)
    assert packed[7, :, 5:].eq(128).all()  # columns 61..63: zero weights
    x, scale = torch.randn(3, 96, generator=g), torch.rand(61, generator=g)
    with pytest.raises(ValueError, match="packed layout is read by the w8a8 kernel only"):
        linear_w8(x, packed, scale, None, False, layout="packed")


@pytest.mark.parametrize(("n", "k"), [(13, 64), (1536, 640), (640, 2048), (70, 96), (8, 32)])
def test_w8a8_kernel_is_its_reference_arithmetic_bit_for_bit(n: int, k: int) -> None:
    """Every row count (one row, row tiles, row blocks of 128 and their remainders) and
    column count (a padded last group, an odd last panel) gives exactly the plain-C result of
    the documented arithmetic, so no tiling or instruction set changes a bit."""
    from loom.kernels import linear_w8a8_reference
    from loom.kernels.w8a8_layout import to_packed_layout

    g = torch.Generator().manual_seed(n + k)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale, bias = torch.rand(n, generator=g) * 0.01, torch.randn(n, generator=g)
    packed = to_packed_layout(w)
    x = torch.randn(131, k, generator=g) * 3
    x[5, :32] = 0.0  # an all-zero block (scale 0)
    x[6, :32] = torch.arange(32) - 15.5  # ties, rounded half to even ...
    x[6, 0] = 127.0  # ... with a scale of exactly 1
    ref = linear_w8a8_reference(x, w, scale, bias)
    assert torch.equal(linear_w8(x, packed, scale, bias, True, layout="packed"), ref)
    for rows in (slice(0, 1), slice(7, 10), slice(2, 130)):
        part = x[rows].contiguous()
        assert torch.equal(linear_w8(part, packed, scale, bias, True, layout="packed"), ref[rows])
    no_bias = linear_w8(x[:4].contiguous(), packed, scale, None, True, layout="packed")
    assert torch.equal(no_bias, linear_w8a8_reference(x[:4].contiguous(), w, scale, None))
    exact = x.double() @ (w.double() * scale.double()[:, None]).T + bias.double()
    error = (ref.double() - exact).abs()
    error[6] = 0  # the outlier block of row 6 rounds coarsely, as meant
    assert error.max() < 0.02 * exact.abs().max()  # int8 rounding only


def test_w8a8_reference_sums_blocks_in_order() -> None:
    """The reference is not just close to a float matmul: summing the blocks in another order
    changes bits (so the bit-for-bit comparisons above can fail)."""
    from loom.kernels import linear_w8a8_reference

    g = torch.Generator().manual_seed(3)
    k = 2048
    x, w = torch.randn(16, k, generator=g), torch.randint(-127, 128, (64, k), dtype=torch.int8,
                                                          generator=g)
    scale = torch.rand(64, generator=g)
    ref = linear_w8a8_reference(x, w, scale, None)
    flipped = linear_w8a8_reference(x.flip(-1).contiguous(), w.flip(-1).contiguous(), scale, None)
    assert not torch.equal(ref, flipped)  # same products and blocks, reversed block order
    torch.testing.assert_close(ref, flipped, atol=1e-3, rtol=1e-5)


def test_argmax_logsumexp_matches_torch_and_takes_the_first_tie() -> None:
    from loom.kernels import argmax_logsumexp

    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 70_001, generator=g) * 6
    x[1, 5] = x[1, 60_000] = 200.0  # a tie across chunks: the first index wins, as in torch
    x[3] = -50.0  # all equal
    idx, lse = argmax_logsumexp(x)
    assert idx.tolist() == x.argmax(dim=-1).tolist() == [idx[0].item(), 5, idx[2].item(), 0]
    torch.testing.assert_close(lse, x.logsumexp(dim=-1), atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 4, 300])
def test_paged_attention_chunks_are_causal(window: int | None, cache_dtype: torch.dtype) -> None:
    """Two sequences with several new tokens each (one spanning many parts of 128 keys); a
    float16 cache gives the float32 result of its own (rounded) values."""
    g = torch.Generator().manual_seed(8)
    block, heads, kv_heads, dim = 16, 4, 1, 32
    stored = torch.randn(2, 40, block, kv_heads, dim, generator=g).to(cache_dtype)
    cache = stored.float()
    tables = torch.tensor([list(range(39, 19, -1)), list(range(0, 20))])
    seq_lens, q_lens = [300, 9], [5, 9]
    q = torch.randn(sum(q_lens), heads, dim, generator=g)
    starts = torch.tensor([0, 5, 14])
    out = paged_attention(q, starts, stored, tables, torch.tensor(seq_lens), 300, 0.2, window,
                          None)
    for i, length in enumerate(seq_lens):
        ref = _dense_attention(q[starts[i] : starts[i + 1]], cache, tables[i], length, 4,
                               window)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], ref, atol=1e-5, rtol=1e-5)


def _dense_attention(rows: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
                     length: int, group: int, window: int | None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: the last len(rows) positions of a sequence of `length` over its keys
    gathered from the paged float32 `cache` by `table`, scale 0.2, causal (and windowed), a
    softmax over the scores (and each head's sink column, then dropped)."""
    ql, kv_heads, dim = rows.shape[0], cache.shape[3], cache.shape[4]
    keys = cache[0][table].reshape(-1, kv_heads, dim)[:length].repeat_interleave(group, 1)
    vals = cache[1][table].reshape(-1, kv_heads, dim)[:length].repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", rows, keys) * 0.2
    q_pos = torch.arange(length - ql, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    visible = k_pos <= q_pos
    if window:
        visible &= k_pos > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        heads = scores.shape[0]
        scores = torch.cat([scores, sinks.view(heads, 1, 1).expand(heads, ql, 1)], dim=-1)
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1)[..., :-1], vals)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)


@pytest.mark.parametrize("window", [None, 100, 200])
@pytest.mark.parametrize("length", [46, 130, 300])
@pytest.mark.parametrize(("kv_heads", "group", "ql", "cache_dtype", "softcap"), [
    (1, 4, 6, torch.float16, None),
    (8, 1, 17, torch.float32, None),  # a chunk's last unit is a single token
    (3, 2, 17, torch.float16, 20.0),
    (2, 9, 3, torch.float16, None),  # a group wider than one pass of 8 heads
])
def test_paged_attention_of_a_position_is_the_same_alone_or_in_a_chunk(
    window: int | None, length: int, kv_heads: int, group: int, ql: int,
    cache_dtype: torch.dtype, softcap: float | None,
) -> None:
    """Bit-identical, not just close: speculative decoding relies on it (a verified draft's
    row must equal what plain decoding computes for that position). A decode row is computed
    position-major over several kv heads (`attend_rows`), a chunk's units head by head
    (`attend_part`): the same numbers."""
    g = torch.Generator().manual_seed(9)
    block, heads, dim = 16, kv_heads * group, 32
    cache = torch.randn(2, 24, block, kv_heads, dim, generator=g).to(cache_dtype)
    tables = torch.arange(23, -1, -1).view(1, -1)
    q = torch.randn(ql, heads, dim, generator=g)
    chunk = paged_attention(q, torch.tensor([0, ql]), cache, tables, torch.tensor([length]),
                            length, 0.2, window, softcap)
    for t in range(ql):
        pos_len = length - ql + 1 + t
        alone = paged_attention(q[t : t + 1], torch.tensor([0, 1]), cache, tables,
                                torch.tensor([pos_len]), pos_len, 0.2, window, softcap)
        assert torch.equal(alone[0], chunk[t]), (t, pos_len)


@pytest.mark.parametrize("window", [None, 100])
def test_paged_attention_of_a_long_chunk_is_the_same_alone_batched_or_in_windows(
    window: int | None
) -> None:
    """A prefill chunk of many units (16 query tokens each), batched with a decode row of
    another sequence: each row is bit-identical to that position computed alone, also when
    a huge max_len bound makes the merge scratch split the step into windows of one unit."""
    g = torch.Generator().manual_seed(10)
    block, heads, kv_heads, dim = 16, 4, 1, 32
    cache = torch.randn(2, 64, block, kv_heads, dim, generator=g).to(torch.float16)
    tables = torch.stack([torch.arange(63, 31, -1), torch.arange(0, 32)])
    ql, length, other = 75, 400, 333
    q = torch.randn(ql + 1, heads, dim, generator=g)
    starts, lens = torch.tensor([0, ql, ql + 1]), torch.tensor([length, other])
    batched = paged_attention(q, starts, cache, tables, lens, length, 0.2, window, None)
    windowed = paged_attention(q, starts, cache, tables, lens, 10**7, 0.2, window, None)
    assert torch.equal(batched, windowed)
    for t in (0, 15, 16, 40, ql - 1):
        pos_len = length - ql + 1 + t
        alone = paged_attention(q[t : t + 1], torch.tensor([0, 1]), cache, tables[:1],
                                torch.tensor([pos_len]), pos_len, 0.2, window, None)
        assert torch.equal(alone[0], batched[t]), t
    decode = paged_attention(q[ql:], torch.tensor([0, 1]), cache, tables[1:],
                             torch.tensor([other]), other, 0.2, window, None)
    assert torch.equal(decode[0], batched[ql])


@pytest.mark.parametrize("max_len", [None, 10**7])
def test_paged_attention_of_decode_rows_around_a_chunk(max_len: int | None) -> None:
    """Decode rows before, between and after prefill chunks in one call (the kernel attends a
    window's chunks first, then its decode rows): every row is bit-identical to its position
    computed alone; a huge max_len bound splits the call into windows of one unit."""
    g = torch.Generator().manual_seed(11)
    block, kv_heads, group, dim = 16, 4, 2, 32
    cache = torch.randn(2, 96, block, kv_heads, dim, generator=g).to(torch.float16)
    tables = torch.stack([torch.randperm(96, generator=g)[:24] for _ in range(4)])
    q_lens, lens = [1, 17, 1, 20], [200, 150, 33, 300]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    q = torch.randn(sum(q_lens), kv_heads * group, dim, generator=g)
    out = paged_attention(q, starts, cache, tables, torch.tensor(lens), max_len or max(lens),
                          0.2, None, None)
    for i, (ql, length) in enumerate(zip(q_lens, lens, strict=True)):
        for t in range(ql):
            row, pos_len = starts[i].item() + t, length - ql + 1 + t
            alone = paged_attention(q[row : row + 1], torch.tensor([0, 1]), cache,
                                    tables[i : i + 1], torch.tensor([pos_len]), pos_len, 0.2,
                                    None, None)
            assert torch.equal(alone[0], out[row]), (i, t)


@pytest.mark.parametrize("window", [None, 8])
def test_paged_attention_sinks_join_each_rows_softmax(window: int | None) -> None:
    """gpt-oss's sinks: one logit per query head in every row's softmax (max and sum), with
    no value; a chunk's rows equal each position computed alone (decode rows), bit for bit."""
    g = torch.Generator().manual_seed(12)
    block, kv_heads, group, dim = 16, 2, 4, 32
    heads = kv_heads * group
    cache = torch.randn(2, 24, block, kv_heads, dim, generator=g).to(torch.float16)
    tables = torch.randperm(24, generator=g).view(1, -1)
    length, ql = 300, 9
    q = torch.randn(ql, heads, dim, generator=g)
    sinks = torch.randn(heads, generator=g) * 3
    sinks[0] = 40.0  # a sink above every score: that head's outputs shrink towards zero
    out = paged_attention(q, torch.tensor([0, ql]), cache, tables, torch.tensor([length]),
                          length, 0.2, window, None, sinks=sinks)
    ref = _dense_attention(q, cache.float(), tables[0], length, group, window, sinks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    plain = paged_attention(q, torch.tensor([0, ql]), cache, tables, torch.tensor([length]),
                            length, 0.2, window, None)
    assert not torch.allclose(out, plain)
    for t in range(ql):
        pos_len = length - ql + 1 + t
        alone = paged_attention(q[t : t + 1], torch.tensor([0, 1]), cache, tables,
                                torch.tensor([pos_len]), pos_len, 0.2, window, None,
                                sinks=sinks)
        assert torch.equal(alone[0], out[t]), t
    with pytest.raises(ValueError, match="one logit per head"):
        paged_attention(q, torch.tensor([0, ql]), cache, tables, torch.tensor([length]),
                        length, 0.2, window, None, sinks=sinks[:3].contiguous())


def test_paged_attention_rejects_other_cache_dtypes() -> None:
    cache = torch.zeros(2, 4, 16, 1, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        paged_attention(torch.zeros(1, 4, 32), torch.tensor([0, 1]), cache,
                        torch.zeros(1, 1, dtype=torch.int64), torch.tensor([1]), 1, 1.0, None,
                        None)
