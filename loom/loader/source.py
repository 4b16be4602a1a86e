"""What `load_model_files` returns: the config, a lazy weight stream and where they came from."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

WeightIterator = Iterator[tuple[str, torch.Tensor]]
# Offered each quantised 2-D tensor while it loads: (hf name, GGUF type id, a function that
# returns a copy of its file blocks as uint8 [rows, bytes per row], called only by a hook
# that keeps them); returns True where the values will never be read (computed from the
# blocks), so the loader need not dequantise them.
BlocksHook = Callable[[str, int, Callable[[], torch.Tensor]], bool]


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: `path` is the HF folder or the .gguf file."""

    path: Path
    format: Literal["hf", "gguf"]

    @property
    def directory(self) -> Path:
        """The folder holding the model files (for tokenizer lookup)."""
        return self.path if self.path.is_dir() else self.path.parent


@dataclass(frozen=True)
class ModelFiles:
    """An HF-style config dict, a one-shot iterator of (hf_name, tensor), and the source."""

    hf_config: dict[str, Any]
    weights: WeightIterator
    source: ModelSource

    def __iter__(self) -> Iterator[Any]:
        """Unpack as (hf_config, weights, source)."""
        return iter((self.hf_config, self.weights, self.source))
