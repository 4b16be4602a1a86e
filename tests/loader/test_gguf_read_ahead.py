"""A first load's reads of a GGUF: each tensor's blocks mapped from the page cache (the
file's bytes, writable, dropped from the cache once unreferenced where the load read them
from disk), read on a thread a bounded distance ahead, and kept tensors yielded without
storage."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_gguf import MOE_KQUANTS, write_tiny_moe

from loom.loader import page_cache
from loom.loader.gguf_file import gguf_to_hf_config, iter_gguf_weights
from loom.loader.gguf_read_ahead import ReadAhead
from loom.loader.gguf_reader import GGUFFile, GGUFTensorInfo


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory) -> Path:
    return write_tiny_moe(tmp_path_factory.mktemp("read-ahead") / "moe.gguf", "qwen3moe",
                          MOE_KQUANTS)


def test_a_mapped_tensor_is_the_files_bytes_and_writable(moe_file, monkeypatch):
    reader = GGUFFile(moe_file)
    dropped: list[tuple[int, int]] = []
    monkeypatch.setattr(page_cache.FilePages, "drop",
                        lambda self, offset, nbytes: dropped.append((offset, nbytes)))
    for info in reader.tensors:
        mapped = reader.map_tensor(info, drop_when_unmapped=True)
        if mapped is None:
            pytest.skip("this kernel cannot read a mapping in at once (MADV_POPULATE_READ)")
        assert np.array_equal(mapped, reader.tensor_data(info)), info.name
        assert np.array_equal(mapped, reader.read_tensor(info)), info.name
        assert mapped.flags.writeable
        view = mapped.reshape(-1)[: 16]
        del mapped  # (reference counting frees a mapping: no collection is needed)
        assert len(dropped) == reader.tensors.index(info)  # a view still holds the mapping
        view[:] = 0  # copy-on-write: the file is untouched
        del view
        start, nbytes = dropped[-1]
        assert start <= info.offset and start + nbytes >= info.offset + info.nbytes
    assert len(dropped) == len(reader.tensors)
    again = GGUFFile(moe_file)
    for info in again.tensors:
        assert np.array_equal(again.tensor_data(info), reader.read_tensor(info))


class _Recorder(GGUFFile):
    """A reader that records, for each tensor it maps, where the loader was then."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.position = -1
        self.reads: list[tuple[int, int]] = []

    def map_tensor(self, info: GGUFTensorInfo, drop_when_unmapped: bool) -> np.ndarray | None:
        self.reads.append((self.tensors.index(info), self.position))
        return super().map_tensor(info, drop_when_unmapped)


@pytest.mark.parametrize("ahead_bytes", [0, 1 << 40])
def test_read_ahead_takes_in_order_within_its_bound(moe_file, ahead_bytes):
    reader = _Recorder(moe_file)
    planned = [at for at, info in enumerate(reader.tensors) if info.as_bytes]
    passed = set(planned[1::3])  # tensors the loader goes past without taking
    ahead = ReadAhead(reader, planned, ahead_bytes=ahead_bytes)
    try:
        for at, info in enumerate(reader.tensors):
            reader.position = at
            if at in planned and at not in passed:
                assert np.array_equal(ahead.take(at), reader.tensor_data(info)), info.name
            ahead.done(at)
        unplanned = next(at for at, info in enumerate(reader.tensors) if not info.as_bytes)
        assert np.array_equal(ahead.take(unplanned),
                              reader.tensor_data(reader.tensors[unplanned]))
    finally:
        ahead.close()
    *in_plan, last = reader.reads
    assert last[0] == unplanned  # read when asked for
    read = [index for index, _ in in_plan]
    assert read == sorted(set(read)) and set(read) <= set(planned)  # in order, once each
    assert set(read) >= set(planned) - passed
    if ahead_bytes == 0:  # a tensor is read once the loader is at the one planned before it
        for index, position in in_plan[1:]:
            assert position >= max(p for p in planned if p < index)


def test_kept_tensors_are_yielded_without_storage_and_their_blocks_are_the_files(moe_file):
    reader = GGUFFile(moe_file)
    config = gguf_to_hf_config(reader)
    kept: dict[str, torch.Tensor] = {}

    def keep(hf_name: str, type_id: int, blocks) -> bool:
        kept[hf_name] = blocks()
        return True

    weights = dict(iter_gguf_weights(reader, config, keep_blocks=keep))
    assert kept, "the hook was offered no tensor"
    for hf_name, blocks in kept.items():
        assert weights[hf_name].is_meta
        assert blocks.dtype == torch.uint8
    files = {info.name: info for info in reader.tensors}
    gate = files["blk.1.ffn_gate_exps.weight"]
    expert = kept["model.layers.1.mlp.experts.2.gate_proj.weight"]
    assert np.array_equal(expert.numpy(), reader.tensor_data(gate)[2].reshape(expert.shape))
    assert not weights["model.layers.1.mlp.gate.weight"].is_meta  # the F32 router's values
