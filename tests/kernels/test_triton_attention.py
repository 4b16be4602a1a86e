"""The Triton paged-attention kernels against the torch reference backend.

On a machine without CUDA they run in Triton's interpreter (TRITON_INTERPRET=1, which
tests/conftest.py sets before anything imports Triton), at small sizes; with CUDA they run
compiled on the GPU instead."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from loom.attention import AttentionMetadata, AttentionSpec, TorchAttentionBackend
from loom.attention.triton_backend import TritonAttentionBackend

# Where the kernels run: compiled on a GPU where there is one, else in the interpreter.
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def _step(seed: int, spec: AttentionSpec, chunks: list[tuple[int, int]], block_size: int,
          dtype: torch.dtype, kv_dtype: torch.dtype, device: str):
    """A random paged cache (blocks shuffled, noise in unused slots) and a step's inputs:
    chunks are (start position, query length) per sequence."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-(s + n) // block_size) for s, n in chunks]
    ids = list(range(sum(need) + 3))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    shape = (2, len(ids), block_size, spec.num_kv_heads, spec.head_dim)
    cache = torch.randn(shape, generator=gen).to(kv_dtype)
    tokens = sum(n for _, n in chunks)
    q = torch.randn(tokens, spec.num_heads, spec.head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, spec.num_kv_heads, spec.head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, spec.num_kv_heads, spec.head_dim, generator=gen).to(dtype)
    md = AttentionMetadata.build([s for s, _ in chunks], [n for _, n in chunks], tables,
                                 block_size, device=device)
    return q.to(device), k.to(device), v.to(device), cache.to(device), md


def _run(backend, spec, q, k, v, cache, md):
    cache = cache.clone()
    md.plan_cache.clear()
    return backend.forward(spec, q, k, v, cache, md), cache


CASES = [
    # (name, heads, kv heads, head dim, window, softcap, chunks)
    ("decode batch", 4, 1, 32, None, None, [(0, 1), (37, 1), (70, 1), (15, 1)]),
    ("prefill and decode", 4, 2, 16, None, None, [(0, 21), (33, 1), (5, 9)]),
    ("sliding window", 2, 1, 32, 24, None, [(40, 1), (10, 30), (0, 50)]),
    ("softcap, no GQA", 2, 2, 16, None, 5.0, [(0, 12), (50, 1), (20, 3)]),
    ("group of three", 6, 2, 16, 16, None, [(3, 40), (64, 1)]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", [None, False, True])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_triton_attention_matches_torch_reference(case, split, device):
    _, heads, kv_heads, dim, window, softcap, chunks = case
    spec = AttentionSpec(heads, kv_heads, dim, dim ** -0.5, window, softcap)
    q, k, v, cache, md = _step(len(chunks) + heads, spec, chunks, 16, torch.float32,
                               torch.float32, device)
    want, want_cache = _run(TorchAttentionBackend(), spec, q, k, v, cache, md)
    # Parts of 32 keys: these contexts (up to 70 keys) cross part boundaries.
    got, got_cache = _run(TritonAttentionBackend(split, part_keys=32), spec, q, k, v, cache,
                          md)
    assert torch.equal(got_cache, want_cache)  # the same slots written
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_attention_reads_float16_cache(device):
    spec = AttentionSpec(4, 1, 32, 32 ** -0.5, None, None)
    q, k, v, cache, md = _step(3, spec, [(0, 18), (40, 1)], 16, torch.float32, torch.float16,
                               device)
    want, _ = _run(TorchAttentionBackend(), spec, q, k, v, cache, md)
    got, _ = _run(TritonAttentionBackend(True, part_keys=32), spec, q, k, v, cache, md)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_parts_fill_the_gpu_within_bounds():
    from loom.kernels.triton_attention import (
        MAX_PROGRAMS,
        PART_KEYS,
        block_q_for,
        programs_for,
        tile_rows,
    )

    assert programs_for(1, 1, 512, 512) == 512 // PART_KEYS  # one program per part at most
    assert programs_for(1, 1, 32768, 512) == MAX_PROGRAMS
    assert programs_for(64, 1, 32768, 512) == 8  # 64 items x 8 programs = 512
    assert programs_for(600, 2, 4096, 512) == 1  # the items alone fill it
    assert programs_for(1, 1, PART_KEYS, 512) == 1  # one part: nothing to split
    assert programs_for(1, 1, 0, 512) == 1
    assert block_q_for(1, 4) == 1  # decodes: one token per item
    assert block_q_for(300, 4) == 16  # prefill: 16 tokens x 4 heads = 64 rows
    assert block_q_for(3, 1) == 4  # verification chunks: the chunk rounded up
    assert tile_rows(1) == tile_rows(4) == 64 and tile_rows(128) == 128  # fixed per model


# (name, heads, kv heads, window, softcap)
INVARIANCE_CASES = [("gqa", 4, 1, None, None), ("window and softcap", 2, 1, 24, 5.0)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", INVARIANCE_CASES, ids=[c[0] for c in INVARIANCE_CASES])
def test_a_rows_output_does_not_depend_on_its_launch(case, device):
    """The same query row over the same keys gives the same bits computed in a prefill
    chunk, as a decode alone, beside other sequences, with one program per item or one per
    part: the fold over fixed parts (the module docstring of triton_attention)."""
    from loom.kernels import triton_attention as ta

    _, heads, kv_heads, window, softcap = case
    dim, page, length, part = 32, 16, 70, 32
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(2, 12, page, kv_heads, dim, generator=gen).to(device)
    table = [5, 2, 9, 0, 7]  # the sequence's blocks (80 slots for its 70 keys)
    q_all = torch.randn(length, heads, dim, generator=gen).to(device)
    other_q = torch.randn(30, heads, dim, generator=gen).to(device)

    def attend(chunks, tables, q, launch):
        split, target = launch
        md = AttentionMetadata.build([s for s, _ in chunks], [n for _, n in chunks], tables,
                                     page, device=device)
        plan = ta.make_plan(md.query_lens_list, md.seq_lens_list, heads // kv_heads,
                            kv_heads, torch.device(device), target, split, part)
        return ta.paged_attention(q, cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                  md.positions, plan, dim ** -0.5, window, softcap)

    # The last row of a prefill computed by one program per item.
    want = attend([(0, length)], [table], q_all, (False, 512))[length - 1]
    others = [(40, 1), (3, 20), (60, 1)]
    other_tables = [[1, 3, 4, 6], [8, 10], [11, 4, 6, 1]]
    # One program per item; one per part; two programs sharing an item's three parts.
    for split in ((False, 512), (True, 512), (None, 2)):
        alone = attend([(length - 1, 1)], [table], q_all[-1:], split)[0]
        assert torch.equal(alone, want), f"decode alone, split={split}"
        q = torch.cat([other_q[:1], q_all[-1:], other_q[1:23]])
        beside = attend([others[0], (length - 1, 1), *others[1:]],
                        [other_tables[0], table, *other_tables[1:]], q, split)[1]
        assert torch.equal(beside, want), f"decode beside others, split={split}"
        chunk = attend([(length - 8, 8)], [table], q_all[-8:], split)[-1]
        assert torch.equal(chunk, want), f"in a chunk of 8, split={split}"


def test_start_up_check_passes_and_catches_broken_kernels(monkeypatch):
    from loom.attention.triton_backend import check_against_reference
    from loom.kernels import triton_attention

    spec = AttentionSpec(4, 1, 32, 32 ** -0.5, 12, None)
    backend = TritonAttentionBackend()
    assert check_against_reference(backend, spec, torch.device(DEVICES[0]), torch.float32,
                                   torch.float32) is None
    assert check_against_reference(backend, spec, torch.device(DEVICES[0]), torch.float32,
                                   torch.float16) is None
    real = triton_attention.paged_attention
    monkeypatch.setattr(triton_attention, "paged_attention",
                        lambda *a, **kw: real(*a, **kw) * 1.01)
    assert "differs from the reference" in check_against_reference(
        backend, spec, torch.device(DEVICES[0]), torch.float32, torch.float32)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image for this GPU")

    monkeypatch.setattr(triton_attention, "paged_attention", broken)
    assert "no kernel image" in check_against_reference(
        backend, spec, torch.device(DEVICES[0]), torch.float32, torch.float32)


def test_runner_falls_back_to_the_reference_when_the_kernels_fail(tiny_models, monkeypatch,
                                                                  caplog):
    """An explicit "triton" that fails its start-up check raises; "auto" (the CUDA default)
    warns and runs the torch backend without graphs."""
    from engine.helpers import make_engine

    from loom.kernels import triton_attention

    folder, _ = tiny_models["gemma3"]
    engine = make_engine(folder, attention_backend="triton", cuda_graph_sizes=[1, 2],
                         max_num_seqs=2, max_model_len=64, device=DEVICES[0])
    runner = engine.runner
    assert runner.backend.name == "triton"

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image for this GPU")

    monkeypatch.setattr(triton_attention, "paged_attention", broken)
    with pytest.raises(RuntimeError, match="triton attention backend fails"):
        make_engine(folder, attention_backend="triton", max_model_len=64, device=DEVICES[0])
    # "auto" where it would pick triton (as on CUDA): a warning, the reference backend, no
    # graphs, and the engine generates.
    from loom.attention.triton_backend import TritonAttentionBackend
    from loom.runner import model_runner

    picked = model_runner.get_attention_backend
    monkeypatch.setattr(model_runner, "get_attention_backend",
                        lambda name, device: TritonAttentionBackend() if name == "auto"
                        else picked(name, device))
    with caplog.at_level("WARNING", logger="loom"):
        engine = make_engine(folder, attention_backend="auto", cuda_graph_sizes=[1, 2],
                             max_num_seqs=2, max_model_len=64, device=DEVICES[0])
    assert engine.runner.backend.name == "torch"
    assert engine.runner.decode_graphs is None and engine.runner.verify_graphs is None
    assert any("Triton attention fails" in r.getMessage() and "no kernel image" in r.getMessage()
               for r in caplog.records)
    from engine.helpers import prompt_ids, run_to_completion

    from loom import SamplingParams

    engine.add_request("r", prompt_ids(9), SamplingParams(temperature=0.0, max_tokens=3))
    assert len(run_to_completion(engine)["r"].outputs[0].token_ids) == 3
