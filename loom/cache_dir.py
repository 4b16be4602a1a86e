"""Where Loom keeps files it derives once and reuses (converted tokenizers, built kernels,
prepared weights, the harmony package's vocabulary file), the identity of a source file
those are keyed by, and how such a file is written (whole or not at all)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def loom_cache_dir(kind: str) -> Path:
    """`$LOOM_CACHE_DIR/<kind>`, or `~/.cache/loom/<kind>` when the variable is unset."""
    root = os.environ.get("LOOM_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "loom"
    return base / kind


def file_identity(path: Path) -> str:
    """'<resolved path>|<size>|<mtime ns>': what a derived file is keyed by, so that a replaced
    or modified source is derived again (OSError when the file is missing)."""
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def write_atomic(target: Path, data: bytes) -> None:
    """Write `data` to `target` through a temporary file in the same folder, then rename:
    a reader never sees a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
