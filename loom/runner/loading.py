"""Build a ready-to-run model from a name or path."""

from __future__ import annotations

from pathlib import Path

import torch

from loom.errors import InvalidModelError
from loom.loader import load_model_files, resolve_model_path
from loom.models.base import CausalLM
from loom.models.config import ModelConfig
from loom.models.layers import fuse_projections
from loom.models.quant import quantize_model_int8
from loom.models.registry import get_model_class

# "int8": weight-only int8; "w8a8": int8 weights and, in small-batch CPU kernels, int8
# activations rounded per block of 32 (faster decode, slightly less exact).
QUANTIZATIONS = ("int8", "w8a8")


def build_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    quantization: str | None = None,
) -> tuple[ModelConfig, CausalLM]:
    """Resolve `path` (alias, HF folder or .gguf), construct the model and load its weights.

    After loading, q/k/v and gate/up projections are stacked into one layer each
    (`fuse_projections`). `quantization="int8"` / `"w8a8"` loads in float32, turns every
    linear layer (and the output projection) into int8, then casts the remaining parameters
    to `dtype`.
    """
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {quantization!r}; known: {QUANTIZATIONS}")
    final_dtype = dtype
    if quantization is not None:
        dtype = torch.float32
    resolved = resolve_model_path(path)
    hf_config, weights, _source = load_model_files(resolved, dtype=dtype)
    architectures = hf_config.get("architectures") or ["<missing 'architectures'>"]
    model_cls = get_model_class(str(architectures[0]))  # unsupported -> error before parsing
    config = ModelConfig.from_hf(hf_config)
    # Construct without allocating or initialising, then fill every parameter from the file.
    with torch.device("meta"):
        model = model_cls(config)
    model = model.to_empty(device=device).to(dtype)
    if model.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    try:
        model.load_weights(weights)
    except InvalidModelError as exc:
        if str(_source.path) in str(exc):  # a file-level error already names the file
            raise
        raise InvalidModelError(f"{_source.path}: {exc}") from None
    fuse_projections(model)
    if quantization is not None:
        quantize_model_int8(model, quantize_activations=quantization == "w8a8")
        for param in model.parameters():
            param.data = param.data.to(final_dtype)
    model.eval()
    model.requires_grad_(False)  # inference only; lets the CPU kernels run in any grad mode
    return config, model
