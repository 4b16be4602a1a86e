"""`read_resident`: a safetensors file's tensors copied into memory of their own, equal to
what safetensors reads, never a view of the file; a damaged file is a ValueError naming the
problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loom.runner.resident_tensors import SMALL_BYTES, read_resident


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "packed": torch.randint(0, 256, (3 * SMALL_BYTES + 5,), dtype=torch.uint8, generator=g),
        "weight": torch.randn(300, 70, generator=g),
        "half": torch.randn(17, 3, generator=g).to(torch.bfloat16),
        "ids": torch.arange(-5, 5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.empty(0, 4),
    }


def test_the_tensors_and_metadata_equal_safetensors_and_are_copies(tmp_path):
    path = tmp_path / "entry.safetensors"
    save_file(_tensors(), str(path), metadata={"aliases": "{}", "note": "x"})
    metadata, got = read_resident(path)
    with safe_open(str(path), framework="pt") as f:
        assert metadata == f.metadata()
        expected = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name
    # Overwriting the file's data leaves what was read unchanged: nothing maps the file.
    before = {name: t.clone() for name, t in got.items()}
    raw = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    raw[header:] = bytes(len(raw) - header)
    path.write_bytes(bytes(raw))
    for name, tensor in got.items():
        assert torch.equal(tensor, before[name]), name


def test_a_truncated_or_malformed_file_is_named(tmp_path):
    path = tmp_path / "entry.safetensors"
    save_file(_tensors(), str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="within the file"):
        read_resident(path)
    path.write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(ValueError, match="truncated prepared file"):
        read_resident(path)
    header = json.dumps({"t": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(ValueError, match="dtype C64"):
        read_resident(path)
