"""A first load's reads past the page cache: O_DIRECT transfers of any byte range into
huge-page buffers that come back to their pool once nothing refers to the data."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_gguf import MOE_BLOCKS32, MOE_KQUANTS, write_tiny_moe

from loom.loader.direct_read import DirectFile, ReusedBuffers
from loom.loader.gguf_read_ahead import ReadAhead
from loom.loader.gguf_reader import GGUFFile, GGUFTensorInfo

MIB = 1 << 20


def _mapping(data: np.ndarray) -> object:
    """The mapping a pool's array is over (an address can be that of an earlier mapping)."""
    base = data
    while isinstance(base, np.ndarray):
        base = base.base
    return base.obj


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> tuple[Path, bytes]:
    path = tmp_path_factory.mktemp("direct") / "data.bin"
    data = np.random.default_rng(0).integers(0, 256, 3 * MIB + 12345, np.uint8).tobytes()
    path.write_bytes(data)
    return path, data


def _direct(path: Path, buffers: ReusedBuffers) -> DirectFile:
    direct = DirectFile.open(path, buffers)
    if direct is None:
        pytest.skip(f"the file system of {path} refuses O_DIRECT")
    return direct


@pytest.mark.parametrize("offset, nbytes", [
    (0, 1), (0, 4096), (1, 4095), (4095, 2), (12345, MIB + 777),
    (3 * MIB, 12345), (3 * MIB + 12344, 1),  # the file's last bytes
    (0, 3 * MIB + 12345),  # all of it
])
def test_a_read_is_the_files_bytes_and_writable(data_file, offset, nbytes):
    path, data = data_file
    direct = _direct(path, ReusedBuffers(16 * MIB))
    got = direct.read(offset, nbytes)
    assert got is not None and got.dtype == np.uint8 and got.shape == (nbytes,)
    assert got.tobytes() == data[offset:offset + nbytes]
    got[:] = 0  # the buffer is this process's: the file is untouched
    assert path.read_bytes() == data


def test_a_read_past_the_end_of_the_file_is_refused(data_file):
    path, data = data_file
    direct = _direct(path, ReusedBuffers(16 * MIB))
    assert direct.read(len(data) - 10, 11) is None
    assert direct.read(len(data) + 4096, 1) is None
    assert direct.read(len(data) - 10, 10).tobytes() == data[-10:]  # it still reads


def test_a_buffer_returns_to_the_pool_only_once_every_view_is_gone(data_file):
    path, data = data_file
    buffers = ReusedBuffers(16 * MIB)
    direct = _direct(path, buffers)
    first = direct.read(0, MIB)
    address = _mapping(first)
    view = first[100:200]
    del first
    second = direct.read(MIB, MIB)  # the first buffer is still referred to by the view
    assert _mapping(second) is not address
    assert view.tobytes() == data[100:200]
    del view
    gc.collect()
    third = direct.read(2 * MIB, MIB)  # now it is free, and reused
    assert _mapping(third) is address
    assert third.tobytes() == data[2 * MIB:3 * MIB]
    assert second.tobytes() == data[MIB:2 * MIB]  # untouched by the reuse


def test_the_pool_reuses_a_buffer_only_for_a_read_that_fills_most_of_it(data_file):
    path, _ = data_file
    buffers = ReusedBuffers(16 * MIB)
    direct = _direct(path, buffers)
    large = direct.read(0, 3 * MIB)
    address = _mapping(large)  # 4 MiB: whole huge pages
    del large
    small = direct.read(0, 4096)  # would leave 2 MiB of a kept buffer unused
    assert _mapping(small) is not address
    near = direct.read(0, 2 * MIB + 8192)
    assert _mapping(near) is address


def test_the_pool_keeps_at_most_its_bound_and_nothing_once_closed(data_file):
    path, _ = data_file
    buffers = ReusedBuffers(2 * MIB)  # room for one 2 MiB buffer
    direct = _direct(path, buffers)
    a, b = direct.read(0, 2 * MIB), direct.read(0, 2 * MIB)
    mappings = [_mapping(a), _mapping(b)]
    del a, b
    again = [direct.read(0, 2 * MIB) for _ in range(2)]  # both held
    assert sum(any(_mapping(x) is kept for kept in mappings) for x in again) == 1
    del again
    buffers.close()
    assert not any(_mapping(direct.read(0, 2 * MIB)) is m for m in mappings)


def test_a_file_read_from_the_disk_is_read_past_the_page_cache(tmp_path):
    path = write_tiny_moe(tmp_path / "moe.gguf", "qwen3moe", MOE_KQUANTS)
    if DirectFile.open(path, ReusedBuffers(0)) is None:
        pytest.skip(f"the file system of {path} refuses O_DIRECT")

    class NoMapping(GGUFFile):
        def map_tensor(self, info: GGUFTensorInfo, drop_when_unmapped: bool) -> None:
            raise AssertionError(f"{info.name} was mapped, not read directly")

    reader = NoMapping(path)
    planned = [at for at, info in enumerate(reader.tensors) if info.as_bytes]
    ahead = ReadAhead(reader, planned, drop_cached=True)
    taken = []
    try:
        for at in planned:
            taken.append(ahead.take(at))
            ahead.done(at)
    finally:
        ahead.close()
    expected = GGUFFile(path)
    for at, got in zip(planned, taken, strict=True):  # every one held until now
        info = expected.tensors[at]
        assert got.shape == expected.tensor_data(info).shape, info.name
        assert np.array_equal(got, expected.tensor_data(info)), info.name
    assert os.path.getsize(path) > 0


@pytest.mark.parametrize("types", [MOE_KQUANTS, MOE_BLOCKS32], ids=["kquants", "blocks32"])
def test_a_model_read_past_the_page_cache_equals_one_read_through_it(tmp_path, monkeypatch,
                                                                     types):
    """The whole first load of a mixture of experts in w4a8 (blocks packed, or kept as the
    model's own), its file read with O_DIRECT, gives the same tensors bit for bit."""
    from loom.loader import gguf_file
    from loom.runner.loading import build_model

    path = write_tiny_moe(tmp_path / "moe.gguf", "qwen3moe", types)
    if DirectFile.open(path, ReusedBuffers(0)) is None:
        pytest.skip(f"the file system of {path} refuses O_DIRECT")
    monkeypatch.setenv("LOOM_PREPARED_CACHE", "0")
    _, mapped = build_model(path, quantization="w4a8")
    direct_reads: list[int] = []
    original = DirectFile.read
    monkeypatch.setattr(DirectFile, "read", lambda self, offset, nbytes: (
        direct_reads.append(nbytes), original(self, offset, nbytes))[1])
    monkeypatch.setattr(gguf_file, "_CACHED", 2.0)  # as if the file were not cached
    _, direct = build_model(path, quantization="w4a8")
    assert direct_reads, "the load read nothing past the page cache"
    expected, got = mapped.state_dict(), direct.state_dict()
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert got[name].view(-1).view(torch.uint8).equal(tensor.view(-1).view(torch.uint8)), \
            name


def test_a_refused_direct_read_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    """A transfer the kernel refuses (or a file that ends early) is read through the page
    cache instead, with the same bytes."""
    path = write_tiny_moe(tmp_path / "moe.gguf", "qwen3moe", MOE_KQUANTS)
    monkeypatch.setattr(DirectFile, "read", lambda self, offset, nbytes: None)
    reader = GGUFFile(path)
    planned = [at for at, info in enumerate(reader.tensors) if info.as_bytes]
    ahead = ReadAhead(reader, planned, drop_cached=True)
    try:
        for at in planned:
            info = reader.tensors[at]
            assert np.array_equal(ahead.take(at), reader.tensor_data(info)), info.name
            ahead.done(at)
    finally:
        ahead.close()
