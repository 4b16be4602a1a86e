"""The torch paged-attention backend against a dense per-sequence reference."""

from __future__ import annotations

import math

import pytest
import torch

from loom.attention import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    CpuAttentionBackend,
    TorchAttentionBackend,
    allocate_kv_caches,
    forward_context,
    get_forward_context,
)
from loom.kernels import cpu_kernels_available, kernel_status

BLOCK = 4


def _dense(q, k, v, start, spec):  # q [n,H,D], k/v [L,Hkv,D] for positions [0, L)
    group = spec.num_heads // spec.num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * spec.scale
    if spec.logit_softcap:
        scores = torch.tanh(scores / spec.logit_softcap) * spec.logit_softcap
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    visible = k_pos <= q_pos
    if spec.sliding_window:
        visible &= k_pos > q_pos - spec.sliding_window
    scores = scores.masked_fill(~visible, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).flatten(1)


def _backend(name: str) -> AttentionBackend:
    if name == "cpu" and not cpu_kernels_available():
        pytest.skip(f"CPU kernels unavailable: {kernel_status()}")
    return CpuAttentionBackend() if name == "cpu" else TorchAttentionBackend()


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_steps_match_dense_reference(
    backend_name: str, window: int | None, softcap: float | None
) -> None:
    """Three steps (prefill chunks, then mixed, then pure decode) match dense attention."""
    torch.manual_seed(0)
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, scale=0.3,
                         sliding_window=window, logit_softcap=softcap)
    lengths = [13, 6, 9]
    full_k = [torch.randn(n, 2, 8) for n in lengths]
    full_v = [torch.randn(n, 2, 8) for n in lengths]
    full_q = [torch.randn(n, 4, 8) for n in lengths]
    tables = [[7, 2, 9, 4], [0, 11], [5, 3, 10]]
    (cache,) = allocate_kv_caches(1, 12, BLOCK, 2, 8, torch.float32, "cpu")
    backend = _backend(backend_name)
    # Per step: (start, end) of each sequence (equal start/end = not scheduled).
    steps = [[(0, 5), (0, 4), (0, 8)], [(5, 12), (4, 5), (8, 9)], [(12, 13), (5, 6)]]
    for step in steps:
        seqs = [i for i, _ in enumerate(step)]
        md = AttentionMetadata.build(
            start_pos=[step[i][0] for i in seqs],
            query_lens=[step[i][1] - step[i][0] for i in seqs],
            block_ids=[tables[i] for i in seqs],
            block_size=BLOCK,
        )
        q = torch.cat([full_q[i][slice(*step[i])] for i in seqs])
        k = torch.cat([full_k[i][slice(*step[i])] for i in seqs])
        v = torch.cat([full_v[i][slice(*step[i])] for i in seqs])
        out = backend.forward(spec, q, k, v, cache, md)
        row = 0
        for i in seqs:
            lo, hi = step[i]
            ref = _dense(full_q[i][lo:hi], full_k[i][:hi], full_v[i][:hi], lo, spec)
            torch.testing.assert_close(out[row : row + hi - lo], ref, atol=1e-5, rtol=1e-5)
            row += hi - lo


def test_metadata_slots_and_positions() -> None:
    """Slots follow the block tables; positions continue each sequence's frontier."""
    md = AttentionMetadata.build([6, 0], [2, 3], [[3, 1], [2]], block_size=4)
    assert md.positions.tolist() == [6, 7, 0, 1, 2]
    assert md.slot_mapping.tolist() == [1 * 4 + 2, 1 * 4 + 3, 8, 9, 10]
    assert md.query_start_loc.tolist() == [0, 2, 5]
    assert md.seq_lens.tolist() == [8, 3]
    assert md.block_tables.tolist() == [[3, 1], [2, 0]]
    assert not md.is_pure_decode


def test_forward_context_is_scoped() -> None:
    """The context exists only inside the `with` block."""
    md = AttentionMetadata.build([0], [1], [[0]], block_size=4)
    with pytest.raises(RuntimeError):
        get_forward_context()
    with forward_context(md, [], TorchAttentionBackend()) as ctx:
        assert get_forward_context() is ctx
    with pytest.raises(RuntimeError):
        get_forward_context()
