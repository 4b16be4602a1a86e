"""Build a ready-to-run model from a name or path."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loom.errors import InvalidModelError
from loom.kernels import W4A8_TYPES, cpu_kernels_available, dequantize_gguf_blocks
from loom.loader import BlocksHook, load_model_files, locate_model_files, resolve_model_path
from loom.models.base import CausalLM
from loom.models.block_embedding import BlockInt8Embedding
from loom.models.config import ModelConfig
from loom.models.layers import fuse_projections
from loom.models.quant import Int8Linear, quantize_model_int8
from loom.models.registry import get_model_class
from loom.models.tensor_parallel import shard_model
from loom.models.w4a8 import (
    BLOCKS_ATTRIBUTE,
    GGUFBlocks,
    W4A8Embedding,
    W4A8Linear,
    computable,
)
from loom.models.weight_shard import Shard
from loom.runner.host_memory import release_freed_memory
from loom.runner.prepared import load_prepared, prepared_path, read_prepared_config, save_prepared

logger = logging.getLogger("loom")

# "int8": weight-only int8; "w8a8": int8 weights and, in small-batch CPU kernels, int8
# activations rounded per block of 32 (faster decode, slightly less exact); "w4a8": a GGUF's
# Q4_K / Q6_K matrices computed from the file's own blocks (loom.models.w4a8), the other
# matrices as w8a8.
QUANTIZATIONS = ("int8", "w8a8", "w4a8")


def build_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    quantization: str | None = None,
    shard: Shard | None = None,
) -> tuple[ModelConfig, CausalLM]:
    """Resolve `path` (alias, HF folder or .gguf), construct the model and load its weights.

    After loading, q/k/v and gate/up projections are stacked into one layer each
    (`fuse_projections`). `quantization="int8"` / `"w8a8"` loads in float32, turns every
    linear layer (and the output projection) into int8, then casts the remaining parameters
    to `dtype`. A GGUF model is prepared once per mode and reused from the disk cache
    (`loom.runner.prepared`; `LOOM_PREPARED_CACHE=0` turns it off).

    `shard`: build only this rank's part of a tensor-parallel model
    (`loom.models.tensor_parallel`): the module tree is cut on the meta device, every weight
    is cut to its slice as it loads, then stacked and quantised per shard. The returned config
    is the whole model's; the collectives are attached by the caller.
    """
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {quantization!r}; known: {QUANTIZATIONS}")
    if quantization == "w4a8" and (shard is not None and shard.world_size > 1):
        raise ValueError("quantization 'w4a8' does not shard over devices yet; use 'w8a8'")
    if quantization == "w4a8" and not cpu_kernels_available():
        raise ValueError("quantization 'w4a8' needs Loom's CPU kernels "
                         "(see loom.kernels.kernel_status())")
    source = locate_model_files(resolve_model_path(path))
    cache = None
    if source.format == "gguf" and os.environ.get("LOOM_PREPARED_CACHE", "1") != "0":
        layout = "packed" if quantization in ("w8a8", "w4a8") and cpu_kernels_available() \
            else "rows"
        cache = prepared_path(source.path, dtype, quantization, layout, shard)
        stored = read_prepared_config(cache)
        if stored is not None:
            stored_config, structure = stored
            model_cls, config = model_architecture(stored_config)
            compact = structure.get("embedding") == "int8-blocks"
            kept = structure.get("w4a8_blocks", {})

            def skeleton() -> CausalLM:
                model = _construct(model_cls, config, dtype, quantization, shard)
                _attach_meta_blocks(model, kept)
                return _prepare(model, dtype, quantization, compact)

            model = load_prepared(cache, skeleton, device)
            if model is not None:
                return config, _for_inference(model)
    built: list[CausalLM] = []  # the model, for the blocks hook (which runs while it loads)
    kept: dict[str, int] = {}  # module -> the type of the blocks it was given (w4a8)
    keep = _blocks_hook(built, kept) if quantization == "w4a8" else None
    hf_config, weights, _ = load_model_files(
        source.path, dtype=_load_dtype(dtype, quantization), keep_blocks=keep)
    model_cls, config = model_architecture(hf_config)
    # Construct without allocating or initialising; each parameter is allocated as its tensor
    # arrives from the file, and each layer is prepared as soon as its last one has.
    with torch.device("meta"):
        model = _construct(model_cls, config, dtype, quantization, shard)
    built.append(model)
    if model.weight_shards:  # a rank's shard: read only its parts of the tensors
        weights = load_model_files(source.path, dtype=_load_dtype(dtype, quantization),
                                   select=model.weight_selector()).weights
    _allocate_buffers(model, device)
    layers = _LayerPreparer(model, dtype, quantization)
    try:
        model.load_weights(weights, on_loaded=layers.loaded, materialize_on=device)
    except InvalidModelError as exc:
        if str(source.path) in str(exc):  # a file-level error already names the file
            raise
        raise InvalidModelError(f"{source.path}: {exc}") from None
    if model.tie_embeddings:  # the output projection still holds the embedding's meta tensor
        model.lm_head.weight = model.model.embed_tokens.weight
    model = _prepare(model, dtype, quantization)
    release_freed_memory()
    if cache is not None:
        try:
            embedding = model.model.embed_tokens
            kind = "int8-blocks" if isinstance(embedding, BlockInt8Embedding) else "dense"
            save_prepared(cache, model, hf_config, {"embedding": kind, "w4a8_blocks": kept})
        except OSError as exc:  # a read-only or full cache only costs the next start time
            logger.warning("could not cache the prepared weights at %s: %s", cache, exc)
    return config, _for_inference(model)


def _blocks_hook(built: list[CausalLM], kept: dict[str, int]) -> BlocksHook:
    """The loader hook of w4a8: the file blocks of every tensor the kernel computes are kept
    on the module that owns the tensor (BLOCKS_ATTRIBUTE), until its layer is prepared;
    `kept` records each such module's block type (what a warm start's structure needs)."""

    def keep(hf_name: str, type_id: int, blocks: Callable[[], torch.Tensor]) -> bool:
        if type_id not in W4A8_TYPES or not built:
            return False
        model = built[0]
        name = model.map_weight_name(hf_name)
        if name is None or not name.endswith(".weight"):
            return False
        owner_name = name.rpartition(".")[0]
        owner = model.get_submodule(owner_name)
        if not computable(type_id, int(owner.weight.shape[1])):
            return False
        setattr(owner, BLOCKS_ATTRIBUTE, GGUFBlocks(type_id, blocks()))
        kept[owner_name] = type_id
        # Every module that holds computable blocks is built from them, or (a stack with a
        # part the kernel cannot compute) has its values decoded from them (`_values_from_blocks`).
        return True

    return keep


def _values_from_blocks(linear: torch.nn.Module) -> None:
    """Give a linear layer whose loader skipped its values (its blocks are kept) the file's
    values, decoded from the blocks (the same bits the loader would have yielded)."""
    blocks = getattr(linear, BLOCKS_ATTRIBUTE, None)
    if blocks is None or blocks.raw.is_meta:
        return
    values = torch.empty(tuple(linear.weight.shape), dtype=torch.float32)
    if not dequantize_gguf_blocks(blocks.raw.numpy(), blocks.type_id, values):
        raise RuntimeError(f"cannot decode GGUF blocks of type {blocks.type_id}")
    linear.weight = torch.nn.Parameter(values, requires_grad=False)


def _w4a8_stack(parts: list[torch.nn.Module]) -> torch.nn.Module:
    """A stacked projection from the file's blocks, or, where the kernel cannot compute
    every part, w8a8 over the parts' values (decoded from the blocks where they were kept)."""
    made = W4A8Linear.from_linears(parts)
    if made is not None:
        return made
    for part in parts:
        _values_from_blocks(part)
    return Int8Linear.stacked(parts, True)


def _attach_meta_blocks(model: CausalLM, kept: dict[str, int]) -> None:
    """Rebuilding a prepared w4a8 model's structure: give each module the (shape-less) blocks
    of the type its file tensor had, so preparation makes the same layers."""
    for name, type_id in kept.items():
        setattr(model.get_submodule(name), BLOCKS_ATTRIBUTE,
                GGUFBlocks(int(type_id), torch.empty(0, dtype=torch.uint8, device="meta")))


def _load_dtype(dtype: torch.dtype, quantization: str | None) -> torch.dtype:
    """int8 modes quantise from float32 weights; the others load in their final dtype."""
    return torch.float32 if quantization is not None else dtype


def model_architecture(hf_config: dict[str, Any]) -> tuple[type[CausalLM], ModelConfig]:
    """The model class an HF config names, and its `ModelConfig`."""
    architectures = hf_config.get("architectures") or ["<missing 'architectures'>"]
    model_cls = get_model_class(str(architectures[0]))  # unsupported -> error before parsing
    return model_cls, ModelConfig.from_hf(hf_config)


def _construct(model_cls: type[CausalLM], config: ModelConfig, dtype: torch.dtype,
               quantization: str | None, shard: Shard | None = None) -> CausalLM:
    """The module tree in the dtype weights load in (on the current default device), with a
    tied output projection sharing the embedding; cut to `shard` (on the meta device)."""
    model = model_cls(config).to(_load_dtype(dtype, quantization))
    if shard is not None and shard.world_size > 1:
        shard_model(model, shard)
    if model.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _prepare(model: CausalLM, dtype: torch.dtype, quantization: str | None,
             compact_embedding: bool | None = None) -> CausalLM:
    """The steps after loading: stack projections, quantise, cast to the final dtype, compact
    the embedding table (also run on the meta device to rebuild a cached model's structure,
    with `compact_embedding` saying what the values decided). Layers already prepared while
    loading are left as they are."""
    embedding = model.model.embed_tokens
    if quantization == "w4a8" and model.tie_embeddings and isinstance(model.lm_head,
                                                                     torch.nn.Linear):
        # The tied output projection computes from the embedding's blocks.
        blocks = getattr(embedding, BLOCKS_ATTRIBUTE, None)
        if blocks is not None:
            setattr(model.lm_head, BLOCKS_ATTRIBUTE, blocks)
    _prepare_module(model, dtype, quantization)
    if quantization == "w4a8" and isinstance(embedding, torch.nn.Embedding):
        # Lookups from the file's blocks (shared with a tied output projection).
        head = model.lm_head if isinstance(model.lm_head, W4A8Linear) else None
        packed = W4A8Embedding.from_embedding(embedding, head if model.tie_embeddings else None)
        if packed is not None:
            model.model.embed_tokens = embedding = packed
    if hasattr(embedding, BLOCKS_ATTRIBUTE):
        delattr(embedding, BLOCKS_ATTRIBUTE)
    if quantization is not None:
        _compact_embedding(model, compact_embedding)
    return model


def _prepare_module(module: torch.nn.Module, dtype: torch.dtype,
                    quantization: str | None) -> None:
    """Stack projections, quantise every linear layer and cast the other parameters to
    `dtype`, in `module` (a whole model or one layer; idempotent). In the int8 modes the
    projections are quantised before they are stacked (the same bits, no float32 stack)."""
    if quantization is None:
        fuse_projections(module)
        return
    activations = quantization in ("w8a8", "w4a8")
    if quantization == "w4a8":  # from the file's blocks where the kernel computes them
        fuse_projections(module, _w4a8_stack)
        quantize_model_int8(module, activations, first=lambda lin: W4A8Linear.from_linears([lin]))
    else:
        fuse_projections(module, lambda parts: Int8Linear.stacked(parts, activations))
        quantize_model_int8(module, quantize_activations=activations)
    for param in module.parameters():
        if param.dtype != dtype:
            param.data = param.data.to(dtype)


def _allocate_buffers(model: CausalLM, device: torch.device | str) -> None:
    """Give every buffer of a model built on the meta device uninitialised storage on
    `device` (as `to_empty` would; parameters are allocated as their weights load)."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.is_meta:
                module.register_buffer(name, torch.empty_like(buffer, device=device),
                                       persistent=name not in module._non_persistent_buffers_set)


class _LayerPreparer:
    """Prepares each decoder layer (`_prepare_module`) as soon as the last of its weights has
    loaded, so a first load holds at most one layer's float32 weights beside the prepared
    layers, never a float32 copy of the model (the embedding is prepared at the end, and a
    tied output projection with it). Weights arrive layer by layer in both GGUF and
    safetensors files; any order is correct, only the peak depends on it."""

    def __init__(self, model: CausalLM, dtype: torch.dtype, quantization: str | None) -> None:
        self._model = model
        self._layers = model.model.layers
        self._dtype, self._quantization = dtype, quantization
        self._pending: dict[int, set[str]] = {}
        for name, _ in model.named_parameters():
            index = _layer_index(name)
            if index is not None:
                self._pending.setdefault(index, set()).add(name)

    def loaded(self, name: str) -> None:
        """`name` was filled: prepare its layer if that was the layer's last weight (an
        untied output projection is quantised at once: as float32 it is the largest single
        tensor of a model with a large vocabulary, 2.1 GB for Llama 3 8B)."""
        if name == "lm_head.weight" and self._quantization is not None:
            head = self._model.lm_head
            w4 = W4A8Linear.from_linears([head]) if self._quantization == "w4a8" else None
            self._model.lm_head = w4 or Int8Linear(head.weight, head.bias,
                                                   self._quantization in ("w8a8", "w4a8"))
            release_freed_memory()
            return
        index = _layer_index(name)
        left = self._pending.get(index) if index is not None else None
        if left is None:
            return
        left.discard(name)
        if not left:
            del self._pending[index]
            _prepare_module(self._layers[index], self._dtype, self._quantization)
            release_freed_memory()


def _layer_index(name: str) -> int | None:
    """The decoder layer a parameter name belongs to ("model.layers.<i>.") or None."""
    parts = name.split(".", 3)
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def _compact_embedding(model: CausalLM, decided: bool | None) -> None:
    """In int8 modes the output projection holds its own int8 copy, so the embedding table
    only serves lookups: keep it as int8 blocks where that is exact (a GGUF Q8_0 table:
    671 MB -> 178 MB for the default model). `decided`: True/False when rebuilding a prepared
    model's structure, None to check the values."""
    embedding = model.model.embed_tokens
    if not isinstance(embedding, torch.nn.Embedding) or decided is False:
        return
    if decided:
        rows, dim = embedding.weight.shape
        model.model.embed_tokens = BlockInt8Embedding(rows, dim, embedding.weight.dtype)
        return
    compact = BlockInt8Embedding.from_embedding(embedding)
    if compact is not None:
        model.model.embed_tokens = compact


def _for_inference(model: CausalLM) -> CausalLM:
    model.eval()
    model.requires_grad_(False)  # inference only; lets the CPU kernels run in any grad mode
    return model
