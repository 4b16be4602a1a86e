"""A disk cache of models prepared for their mode: weights in their final dtype and layout.

Preparing a GGUF model costs seconds on every start: dequantising its blocks, stacking q/k/v
and gate/up, rounding to int8 for "int8"/"w8a8". The prepared state is saved once as one
safetensors file under `loom_cache_dir("prepared")`, keyed by the source file's identity
(resolved path, size, modification time), the dtype, the quantization, the weight layout and
`FORMAT`. A warm start parses nothing from the GGUF: it builds the module tree on the meta
device (no memory, no initialisation), applies the same structural steps there, and assigns
the stored tensors in place (on a CPU read into huge pages, not mapped: see
`loom.runner.resident_tensors`). Only GGUF sources are cached (a float safetensors checkpoint
already loads as fast as the cache would); the newest `KEEP` entries are kept.

A damaged entry (truncated, unreadable, mismatching the module tree) is deleted and the model
is prepared again from its source.

A first load writes its entry on a thread (`save_prepared_in_background`): the model runs
while the file is written, which at disk speed took longer than preparing it (a 1.7B Q4_K_M
file: 2 GB of w8a8 weights, about 7 s of a 14.5 s first load). The file appears atomically
when complete; a later load in the same process waits for it (`wait_for_prepared_writes`),
and the interpreter waits for the thread at exit.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loom.cache_dir import file_identity, loom_cache_dir
from loom.models.base import CausalLM
from loom.models.weight_shard import Shard
from loom.runner.resident_tensors import read_resident

logger = logging.getLogger("loom")

# Bump when what a prepared file holds changes (module tree, layouts, quantisation rules).
FORMAT = "6"  # 6: w4a8 records keep their scales in 16 bits
# Prepared entries kept on disk (the least recently used beyond these are deleted).
KEEP = 4


def prepared_path(source: Path, dtype: torch.dtype, quantization: str | None,
                  layout: str, shard: Shard | None = None) -> Path:
    """The cache file of `source` prepared as (dtype, quantization, int8 layout), or of one
    rank's shard of it."""
    parts = [FORMAT, file_identity(source), str(dtype), str(quantization), layout]
    if shard is not None and shard.world_size > 1:
        parts.append(f"tp{shard.rank}/{shard.world_size}")
    ident = "|".join(parts)
    digest = hashlib.sha256(ident.encode()).hexdigest()[:20]
    return loom_cache_dir("prepared") / f"{source.stem}-{digest}.safetensors"


# Entries being written by `save_prepared_in_background`, by path.
_writes: dict[Path, threading.Thread] = {}
_writes_lock = threading.Lock()


def save_prepared_in_background(path: Path, model: CausalLM, hf_config: dict[str, Any],
                                structure: dict[str, Any]) -> None:
    """Write the model's state (tied tensors once), its config and `structure` (the choices
    that shaped the module tree from the weights' values, which a warm start cannot see),
    atomically, on a thread. The tensors are gathered here (later changes to the module tree
    do not reach the file); a failure to write is logged, as a read-only or full cache only
    costs the next start time."""
    tensors, aliases = _stored_tensors(model)

    def write() -> None:
        try:
            _write(path, tensors, aliases, hf_config, structure)
        except Exception as exc:  # the thread has no caller to raise to
            logger.warning("could not cache the prepared weights at %s: %s", path, exc)

    thread = threading.Thread(target=write, name="loom-prepared-writer")
    with _writes_lock:
        _writes[path] = thread
    thread.start()


def wait_for_prepared_writes(path: Path | None = None) -> None:
    """Return once the background writes of `path` (None: of every entry) have finished."""
    with _writes_lock:
        threads = [t for p, t in _writes.items() if path is None or p == path]
    for thread in threads:
        thread.join()
    with _writes_lock:
        for p, t in list(_writes.items()):
            if not t.is_alive():
                del _writes[p]


def _stored_tensors(model: CausalLM) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state to store (each tensor once) and the names that alias a stored one."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int], str] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = tensor.detach().contiguous()
    return tensors, aliases


def _write(path: Path, tensors: dict[str, torch.Tensor], aliases: dict[str, str],
           hf_config: dict[str, Any], structure: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"hf_config": json.dumps(hf_config),
                                          "structure": json.dumps(structure),
                                          "aliases": json.dumps(aliases)})
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    _prune(path.parent)


def read_prepared_config(path: Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The HF config and the structure stored with a prepared file, or None when there is no
    usable entry."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        return json.loads(meta["hf_config"]), json.loads(meta["structure"])
    except Exception as exc:  # a damaged entry: drop it, prepare afresh
        logger.warning("discarding unreadable prepared weights %s: %s", path, exc)
        path.unlink(missing_ok=True)
        return None


def load_prepared(path: Path, skeleton: Callable[[], CausalLM],
                  device: torch.device | str) -> CausalLM | None:
    """The model `skeleton()` builds on the meta device, filled from `path` (on a CPU, each
    tensor copied into memory of its own: `loom.runner.resident_tensors`); None (and the entry
    deleted) when the file does not match it."""
    try:
        if torch.device(device).type == "cpu":  # copied into huge pages (resident_tensors)
            metadata, state = read_resident(path)
        else:
            with safe_open(str(path), framework="pt", device=str(torch.device(device))) as f:
                metadata = f.metadata() or {}
                state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        aliases: dict[str, str] = json.loads(metadata.get("aliases", "{}"))
        for alias, name in aliases.items():
            state[alias] = state[name]
        with torch.device("meta"):
            model = skeleton()
        model.load_state_dict(state, strict=True, assign=True)
        if model.tie_embeddings and isinstance(model.lm_head, torch.nn.Linear):
            # assign=True wrapped the shared tensor twice: make it one parameter again
            model.lm_head.weight = model.model.embed_tokens.weight
    except Exception as exc:  # damaged or stale: prepare afresh from the source
        logger.warning("discarding prepared weights %s: %s", path, exc)
        path.unlink(missing_ok=True)
        return None
    os.utime(path)  # most recently used
    return model


# A temporary file this old is a write whose process was killed (a write takes seconds).
_STALE_TMP_S = 3600.0


def _prune(folder: Path) -> None:
    entries = sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime,
                     reverse=True)
    for stale in entries[KEEP:]:
        stale.unlink(missing_ok=True)
    now = time.time()
    for tmp in folder.glob("*.tmp"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > _STALE_TMP_S:
                tmp.unlink()
