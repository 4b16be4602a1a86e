"""Where Loom keeps files it derives once and reuses (converted tokenizers, built kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def loom_cache_dir(kind: str) -> Path:
    """`$LOOM_CACHE_DIR/<kind>`, or `~/.cache/loom/<kind>` when the variable is unset."""
    root = os.environ.get("LOOM_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "loom"
    return base / kind
