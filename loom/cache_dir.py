"""Where Loom keeps files it derives once and reuses (converted tokenizers, built kernels,
prepared weights), and the identity of a source file those are keyed by."""

from __future__ import annotations

import os
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
