"""Build a ready-to-run model from a name or path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loom.errors import InvalidModelError
from loom.kernels.pack_workers import packing_in_background
from loom.loader import WeightIterator, load_model_files, locate_model_files, resolve_model_path
from loom.models.base import CausalLM
from loom.models.block_embedding import BlockInt8Embedding
from loom.models.config import ModelConfig
from loom.models.quant_method import QuantMethod, get_quant_method
from loom.models.registry import get_model_class
from loom.models.tensor_parallel import shard_model
from loom.models.weight_shard import Shard
from loom.runner.host_memory import release_freed_memory
from loom.runner.prepared import (
    load_prepared,
    prepared_path,
    read_prepared_config,
    save_prepared_in_background,
    wait_for_prepared_writes,
)


def build_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    quantization: str | None = None,
    shard: Shard | None = None,
) -> tuple[ModelConfig, CausalLM]:
    """Resolve `path` (alias, HF folder or .gguf), construct the model and load its weights.

    `quantization` names the weight mode (`loom.models.quant_method`: None for exact float,
    "int8", "w8a8", "w4a8"); its method decides how each layer is prepared as soon as its
    weights have loaded (q/k/v and gate/up stacked into one layer each, quantised in the int8
    modes, the other parameters then cast to `dtype`). A GGUF model is prepared once per
    mode and reused from the disk cache (`loom.runner.prepared`; `LOOM_PREPARED_CACHE=0`
    turns it off).

    `shard`: build only this rank's part of a tensor-parallel model
    (`loom.models.tensor_parallel`): the module tree is cut on the meta device, every weight
    is cut to its slice as it loads, then stacked and quantised per shard. The returned config
    is the whole model's; the collectives are attached by the caller.
    """
    method = get_quant_method(quantization)
    method.check(shard)
    source = locate_model_files(resolve_model_path(path))
    cache = None
    if source.format == "gguf" and os.environ.get("LOOM_PREPARED_CACHE", "1") != "0":
        cache = prepared_path(source.path, dtype, method.name, method.weight_layout(), shard)
        wait_for_prepared_writes(cache)  # this process may be writing it
        stored = read_prepared_config(cache)
        if stored is not None:
            stored_config, structure = stored
            model_cls, config = model_architecture(stored_config)
            compact = structure.get("embedding") == "int8-blocks"
            kept = structure.get("w4a8_blocks", {})

            def skeleton() -> CausalLM:
                model = _construct(model_cls, config, dtype, method, shard)
                method.attach_kept_blocks(model, kept)
                return _prepare(model, dtype, method, compact)

            model = load_prepared(cache, skeleton, device)
            if model is not None:
                return config, _for_inference(model)
    built: list[CausalLM] = []  # the model, for the blocks hook (which runs while it loads)
    kept: dict[str, int] = {}  # module -> the type of the blocks it was given (w4a8)
    keep_blocks = method.blocks_hook(built, kept)
    hf_config, weights, _ = load_model_files(
        source.path, dtype=method.load_dtype(dtype), keep_blocks=keep_blocks)
    model_cls, config = model_architecture(hf_config)
    # Construct without allocating or initialising; each parameter is allocated as its tensor
    # arrives from the file, and each layer is prepared as soon as its last one has.
    with torch.device("meta"):
        model = _construct(model_cls, config, dtype, method, shard)
    built.append(model)
    if model.weight_shards:  # a rank's shard: read only its parts of the tensors
        weights = load_model_files(source.path, dtype=method.load_dtype(dtype),
                                   select=model.weight_selector(),
                                   keep_blocks=keep_blocks).weights
    _allocate_buffers(model, device)
    # Packed weights are written on worker threads while the loader goes on; all of them
    # by the end of the block, before anything reads them.
    with packing_in_background():
        _load_and_prepare(model, weights, dtype, device, method, source.path)
    release_freed_memory()
    if cache is not None:  # written while the model runs (see loom.runner.prepared)
        embedding = model.model.embed_tokens
        kind = "int8-blocks" if isinstance(embedding, BlockInt8Embedding) else "dense"
        save_prepared_in_background(cache, model, hf_config,
                                    {"embedding": kind, "w4a8_blocks": kept})
    return config, _for_inference(model)


def _load_and_prepare(model: CausalLM, weights: WeightIterator, dtype: torch.dtype,
                      device: torch.device | str, method: QuantMethod, path: Path) -> None:
    """Fill the model built on the meta device from `weights`, preparing each decoder layer
    as soon as it has loaded, then the rest (`_prepare`)."""
    layers = _LayerPreparer(model, dtype, method)
    try:
        model.load_weights(weights, on_loaded=layers.loaded, materialize_on=device)
    except InvalidModelError as exc:
        if str(path) in str(exc):  # a file-level error already names the file
            raise
        raise InvalidModelError(f"{path}: {exc}") from None
    if model.tie_embeddings:  # the output projection still holds the embedding's meta tensor
        model.lm_head.weight = model.model.embed_tokens.weight
    _prepare(model, dtype, method)
    _check_materialized(model)


def _check_materialized(model: CausalLM) -> None:
    """RuntimeError naming a tensor left on the meta device: a weight the loader gave no
    values (its file blocks were kept) whose module the preparation did not rebuild."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            raise RuntimeError(f"{name} has no values after loading (meta tensor)")


def model_architecture(hf_config: dict[str, Any]) -> tuple[type[CausalLM], ModelConfig]:
    """The model class an HF config names, and its `ModelConfig`."""
    architectures = hf_config.get("architectures") or ["<missing 'architectures'>"]
    model_cls = get_model_class(str(architectures[0]))  # unsupported -> error before parsing
    return model_cls, ModelConfig.from_hf(hf_config)


def _construct(model_cls: type[CausalLM], config: ModelConfig, dtype: torch.dtype,
               method: QuantMethod, shard: Shard | None = None) -> CausalLM:
    """The module tree in the dtype weights load in (on the current default device), with a
    tied output projection sharing the embedding; cut to `shard` (on the meta device)."""
    model = model_cls(config).to(method.load_dtype(dtype))
    if shard is not None and shard.world_size > 1:
        shard_model(model, shard)
    if model.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _prepare(model: CausalLM, dtype: torch.dtype, method: QuantMethod,
             compact_embedding: bool | None = None) -> CausalLM:
    """The steps after loading (`QuantMethod.prepare_model`: stack projections, quantise,
    the output projection and the embedding), then the other parameters cast to the final
    dtype (also run on the meta device to rebuild a cached model's structure, with
    `compact_embedding` saying what the values decided). Layers already prepared while
    loading are left as they are."""
    method.prepare_model(model, compact_embedding)
    _cast_parameters(model, dtype, method)
    return model


def _prepare_layer(module: nn.Module, dtype: torch.dtype, method: QuantMethod) -> None:
    """Stack and quantise one decoder layer's projections and cast its other parameters to
    `dtype` (idempotent). In the int8 modes the projections are quantised before they are
    stacked (the same bits, no float32 stack)."""
    method.prepare_layer(module)
    _cast_parameters(module, dtype, method)


def _cast_parameters(module: nn.Module, dtype: torch.dtype, method: QuantMethod) -> None:
    """The parameters left in the load dtype (norms, biases, a float embedding) cast to the
    model's, where the method loads in another dtype."""
    if method.load_dtype(dtype) == dtype:
        return
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
    """Prepares each decoder layer (`_prepare_layer`) as soon as the last of its weights has
    loaded, so a first load holds at most one layer's float32 weights beside the prepared
    layers, never a float32 copy of the model (the embedding is prepared at the end, and a
    tied output projection with it). Weights arrive layer by layer in both GGUF and
    safetensors files; any order is correct, only the peak depends on it."""

    def __init__(self, model: CausalLM, dtype: torch.dtype, method: QuantMethod) -> None:
        self._model = model
        self._layers = model.model.layers
        self._dtype, self._method = dtype, method
        self._pending: dict[int, set[str]] = {}
        for name, _ in model.named_parameters():
            index = _layer_index(name)
            if index is not None:
                self._pending.setdefault(index, set()).add(name)

    def loaded(self, name: str) -> None:
        """`name` was filled: prepare its layer if that was the layer's last weight (an
        untied output projection is quantised at once: as float32 it is the largest single
        tensor of a model with a large vocabulary, 2.1 GB for Llama 3 8B)."""
        if name == "lm_head.weight":
            self._model.lm_head = self._method.output_projection(self._model.lm_head)
            release_freed_memory()
            return
        index = _layer_index(name)
        left = self._pending.get(index) if index is not None else None
        if left is None:
            return
        left.discard(name)
        if not left:
            del self._pending[index]
            _prepare_layer(self._layers[index], self._dtype, self._method)
            release_freed_memory()


def _layer_index(name: str) -> int | None:
    """The decoder layer a parameter name belongs to ("model.layers.<i>.") or None."""
    parts = name.split(".", 3)
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def _for_inference(model: CausalLM) -> CausalLM:
    model.eval()
    model.requires_grad_(False)  # inference only; lets the CPU kernels run in any grad mode
    return model
