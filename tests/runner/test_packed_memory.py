"""Where a first load writes packed weights: tensors carved from huge-page mappings that are
unmapped with their last tensor, written on worker threads by the end of the load's
`packing_in_background` block with the bytes an inline pack writes; and a weight given no
values (its file blocks kept) never survives the load."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_gguf import MOE_KQUANTS, Q4_K, Q6_K, random_blocks, write_tiny_moe

from loom.kernels import cpu_kernels_available, w4a8_pack
from loom.kernels.huge_pages import HugePageArena
from loom.kernels.pack_workers import packed_tensor, packing_in_background
from loom.runner import loading
from loom.runner.prepared import wait_for_prepared_writes

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="no CPU kernels")


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))


def test_arena_tensors_are_aligned_disjoint_and_own_their_bytes():
    arena = HugePageArena(chunk_bytes=4 << 20)
    shapes = [(3, 5, 7), (1000,), (2, 1 << 20), (5 << 20,), (0, 4)]
    tensors = [arena.empty(shape) for shape in shapes]
    for i, (tensor, shape) in enumerate(zip(tensors, shapes, strict=True)):
        assert tensor.shape == shape and tensor.dtype == torch.uint8
        assert tensor.is_contiguous() and tensor.data_ptr() % 64 == 0
        tensor.fill_(i)
    for i, tensor in enumerate(tensors):
        assert bool((tensor == i).all())
        # Its own storage over exactly its bytes: the prepared-weights writer (safetensors)
        # sees no shared tensors.
        assert tensor.untyped_storage().nbytes() == tensor.numel()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in tensors if t.numel())
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc")
def test_arena_memory_is_returned_with_its_last_tensor():
    arena = HugePageArena()
    before = _rss_anon()
    tensors = [arena.empty((1 << 20,)) for _ in range(192)]
    for written in tensors:
        written.fill_(1)
    del written
    assert _rss_anon() - before > 150 << 20
    last = tensors.pop()
    tensors.clear()
    assert _rss_anon() - before > 0  # the last tensor holds its chunk
    del last
    assert _rss_anon() - before < 16 << 20


def test_a_pack_queued_in_the_block_fails_when_the_block_ends():
    def fail(out: torch.Tensor) -> None:
        raise ValueError("cannot pack")

    with pytest.raises(ValueError, match="cannot pack"), packing_in_background(threads=2):
        packed_tensor((8,), fail, input_bytes=8)


@needs_kernels
def test_packs_written_by_workers_equal_inline_packs():
    rng = np.random.default_rng(0)
    jobs = [(torch.from_numpy(random_blocks(rng, rows, cols, type_id)), type_id, rows, cols)
            for type_id in (Q4_K, Q6_K) for rows, cols in ((64, 512), (520, 256), (8, 1024))]
    inline = [w4a8_pack(*job) for job in jobs]
    with packing_in_background(threads=3):
        queued = [w4a8_pack(*job) for job in jobs]
    for a, b in zip(inline, queued, strict=True):
        assert torch.equal(a, b)


@needs_kernels
def test_a_first_load_leaves_no_weight_without_values(tmp_path, monkeypatch):
    """The MoE's kept tensors are yielded on the meta device; every one is rebuilt from its
    blocks, and a module that kept none of them would fail the load."""
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    path = write_tiny_moe(tmp_path / "moe.gguf", "qwen3moe", MOE_KQUANTS)
    _, model = loading.build_model(path, quantization="w4a8")
    wait_for_prepared_writes()
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    model.model.layers[0].mlp.gate.weight = torch.nn.Parameter(
        torch.empty(model.model.layers[0].mlp.gate.weight.shape, device="meta"))
    with pytest.raises(RuntimeError, match=r"mlp\.gate\.weight has no values"):
        loading._check_materialized(model)
