"""Damaged model files (truncated GGUF or safetensors, a config.json that disagrees with the
weights or is not JSON) raise `InvalidModelError` naming the file and the problem."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from loom import LLM
from loom.errors import InvalidModelError, UnsupportedModelError
from loom.loader.gguf_reader import GGUFFile
from loom.runner import build_model

MB = 1 << 20


def _head(src: Path, dst: Path, n_bytes: int) -> Path:
    """Copy the first `n_bytes` of `src` to `dst` (what an interrupted download leaves)."""
    with src.open("rb") as fin, dst.open("wb") as fout:
        while n_bytes > 0:
            chunk = fin.read(min(n_bytes, 8 * MB))
            if not chunk:
                break
            fout.write(chunk)
            n_bytes -= len(chunk)
    return dst


@pytest.fixture
def tiny_folder(tiny_models: dict, tmp_path: Path) -> Path:
    """A private copy of the tiny Llama HF folder, free to damage."""
    return Path(shutil.copytree(tiny_models["llama"][0], tmp_path / "tiny-llama"))


# ------------------------------------------------------------------ GGUF


def test_gguf_cut_inside_metadata(gemma_path: Path, tmp_path: Path) -> None:
    """The first 1 MB of the Gemma file ends inside its metadata (the vocabulary)."""
    path = _head(gemma_path, tmp_path / "gemma-1mb.gguf", MB)
    with pytest.raises(InvalidModelError) as info:
        build_model(path)
    assert str(info.value) == (
        f"{path}: truncated or corrupt GGUF header: the metadata runs past the end of the"
        " file (1,048,576 bytes)"
    )
    assert isinstance(info.value, ValueError)  # `except ValueError` callers still catch it


def test_gguf_cut_inside_tensor_data(gemma_path: Path, tmp_path: Path) -> None:
    """100 MB of the file: the header parses, the tensor data stops short."""
    path = _head(gemma_path, tmp_path / "gemma-100mb.gguf", 100 * MB)
    full = gemma_path.stat().st_size
    with pytest.raises(InvalidModelError) as info:
        build_model(path)
    message = str(info.value)
    assert message.startswith(f"{path}: truncated: 104,857,600 of {full:,} bytes; tensor '")
    assert message.endswith("' runs past the end of the file (an interrupted download?)")


def test_tiny_gguf_cut_in_half(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    full = path.stat().st_size
    assert [t.name for t in GGUFFile(path).tensors] == ["token_embd.weight", "output_norm.weight"]
    cut = _head(path, tmp_path / "half.gguf", full // 2)
    with pytest.raises(InvalidModelError, match=re.escape(f"of {full:,} bytes")) as info:
        GGUFFile(cut)
    assert str(info.value).startswith(f"{cut}: truncated: {full // 2:,} of ")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"", "empty (0 bytes), not a complete GGUF file"),
        (b"GG", "truncated: only 2 bytes, not a complete GGUF file"),
        (b"GGUF\x03\x00\x00\x00", "truncated or corrupt GGUF header"),
        # One key whose u32 array claims 2**62 elements: it cannot fit in the file.
        (
            b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a"
            + struct.pack("<IIQ", 9, 4, 1 << 62),
            "truncated or corrupt GGUF header: the metadata runs past the end of the file",
        ),
        # A key whose length runs past the end.
        (
            b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1000) + b"abc",
            "truncated or corrupt GGUF header",
        ),
    ],
    ids=["empty", "shorter-than-magic", "no-counts", "huge-array", "long-string"],
)
def test_gguf_short_or_corrupt_header(content: bytes, expected: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(InvalidModelError) as info:
        GGUFFile(path)
    assert str(info.value).startswith(f"{path}: {expected}")


def test_not_a_gguf_is_still_unsupported(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip, not a gguf")
    with pytest.raises(UnsupportedModelError, match="is not a GGUF file"):
        GGUFFile(path)


# ------------------------------------------------------------------ safetensors


def test_safetensors_cut_inside_header(tiny_folder: Path) -> None:
    shard = tiny_folder / "model.safetensors"
    (header_len,) = struct.unpack("<Q", shard.read_bytes()[:8])
    data = shard.read_bytes()[:100]
    shard.write_bytes(data)
    with pytest.raises(InvalidModelError) as info:
        build_model(tiny_folder)
    assert str(info.value) == (
        f"{shard}: truncated: 100 of at least {8 + header_len:,} bytes; the safetensors header"
        " runs past the end of the file (an interrupted download?)"
    )


def test_safetensors_cut_inside_data(tiny_folder: Path) -> None:
    """Through the public `LLM` entry point."""
    shard = tiny_folder / "model.safetensors"
    full = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: full // 2])
    with pytest.raises(InvalidModelError) as info:
        LLM(model=str(tiny_folder))
    assert str(info.value) == (
        f"{shard}: truncated: {full // 2:,} of {full:,} bytes (an interrupted download?)"
    )
    assert "," in f"{full:,}"  # big enough for a thousands separator


def test_safetensors_corrupt_header(tiny_folder: Path) -> None:
    shard = tiny_folder / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\xff\xfe{["  # the JSON header no longer parses
    shard.write_bytes(bytes(data))
    with pytest.raises(InvalidModelError, match=r"model\.safetensors: corrupt safetensors header"):
        build_model(tiny_folder)


# ------------------------------------------------------------------ config.json


@pytest.mark.parametrize(
    ("key", "value", "tensor"),
    [("hidden_size", 96, r"[\w.]+"), ("intermediate_size", 256, r"model\.layers\.\d+\.mlp\.\w+")],
)
def test_config_disagrees_with_weights(
    tiny_folder: Path, key: str, value: int, tensor: str
) -> None:
    config_path = tiny_folder / "config.json"
    config = json.loads(config_path.read_text())
    right = config[key]
    config[key] = value
    config_path.write_text(json.dumps(config))
    with pytest.raises(InvalidModelError) as info:
        build_model(tiny_folder)
    message = str(info.value)
    assert message.startswith(f"{tiny_folder}: "), message  # names the model folder
    message = message.removeprefix(f"{tiny_folder}: ")
    assert re.fullmatch(
        rf"tensor '{tensor}\.weight' has shape \([\d, ]+\), config expects \([\d, ]+\)"
        r" \(the model config and the weights disagree\)",
        message,
    ), message
    shapes = message.split("has shape ")[1]
    assert str(right) in shapes and str(value) in shapes


def test_config_not_json(tiny_folder: Path) -> None:
    config_path = tiny_folder / "config.json"
    config_path.write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,')
    with pytest.raises(InvalidModelError) as info:
        build_model(tiny_folder)
    assert str(info.value).startswith(f"{config_path}: not valid JSON (")


def test_intact_tiny_model_loads(tiny_folder: Path) -> None:
    config, model = build_model(tiny_folder)
    assert config.hidden_size == 64
    assert sum(p.numel() for p in model.parameters()) > 0


def test_a_block_type_loom_cannot_decode_is_named_before_loading(tmp_path: Path) -> None:
    """A tensor stored as a type no decoder here reads (Q8_1, an activation format) is an
    UnsupportedModelError naming the tensor and its type, raised when the file is opened,
    before any weight is read; the decodable types pass."""
    gguf = pytest.importorskip("gguf")
    from loom.loader.gguf_file import check_tensor_types

    def tiny(name: str, qtype: object) -> Path:
        path = tmp_path / f"{name}.gguf"
        writer = gguf.GGUFWriter(str(path), arch="llama")
        nbytes = gguf.GGML_QUANT_SIZES[qtype][1]
        writer.add_tensor("token_embd.weight", np.zeros((4, 2 * nbytes), dtype=np.uint8),
                          raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    types = gguf.GGMLQuantizationType
    for ok in (types.Q4_K, types.Q8_0, types.IQ4_XS):
        check_tensor_types(GGUFFile(tiny(ok.name, ok)))
    with pytest.raises(UnsupportedModelError,
                       match=re.escape("'token_embd.weight' is stored as Q8_1, a block "
                                       "type Loom cannot decode")):
        check_tensor_types(GGUFFile(tiny("q8_1", types.Q8_1)))
