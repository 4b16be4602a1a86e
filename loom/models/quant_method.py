"""Quantisation methods: one object per weight mode, owning how a model's linear layers are
made from the file, prepared and applied.

The loader (`loom.runner.loading`) and the mode choice (`loom.engine.mode`) ask the method
object instead of comparing mode names: which dtype the file's tensors load in, which file
blocks are kept as they are (`blocks_hook`), how a decoder layer's projections are stacked
and quantised once its weights have loaded (`prepare_layer`), what the output projection and
the embedding become, and where the method cannot run (`check`). Which fused-decoder kind runs
a prepared layer follows from the layer's class (`loom.models.fused_decode._linear`). A new
weight format is one subclass here, its layer class and its kernel.

- `QuantMethod` itself (quantization=None, `FLOAT`): the checkpoint's (dequantised) values
  in the model dtype.
- `Int8Method` ("int8"): per-output-channel int8 weights, float activations.
- `W8A8Method` ("w8a8"): int8 weights and int8 activations per block of 32, one arithmetic
  for every call on Loom's CPU kernels (bit-identical across calls, as w4a8).
- `W4A8Method` ("w4a8", the default for a quantised GGUF on the CPU kernels): a GGUF's
  K-quant and blocks-of-32 matrices computed from the file's own blocks (`loom.models.w4a8`),
  every other matrix as w8a8.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from loom.kernels import W4A8_TYPES, cpu_kernels_available, dequantize_gguf_blocks
from loom.loader import BlocksHook
from loom.models.base import CausalLM
from loom.models.block_embedding import BlockInt8Embedding
from loom.models.layers import fuse_projections
from loom.models.quant import Int8Linear, quantize_model_int8
from loom.models.w4a8 import (
    BLOCKS_ATTRIBUTE,
    GGUFBlocks,
    W4A8Embedding,
    W4A8Linear,
    computable,
    shard_blocks,
)
from loom.models.weight_shard import Shard


class QuantMethod:
    """Exact float weights: the base every method refines (see the module docstring)."""

    name: str | None = None
    # Activations rounded to int8 per block of 32 (the w8a8 arithmetic) in the linear layers.
    int8_activations = False
    # Runs only on Loom's CPU kernels (no torch fallback that a CUDA device could run).
    needs_cpu_kernels = False
    # Cuts its layers into tensor-parallel shards.
    shards = True
    # Its layers can multiply compute-bound calls in another dtype (`prefill_dtype`).
    large_batch_dtypes = True

    def check(self, shard: Shard | None) -> None:
        """ValueError naming why this method cannot build the model here."""
        if not self.shards and shard is not None and shard.world_size > 1:
            raise ValueError(f"quantization {self.name!r} does not shard over devices yet; "
                             "use 'w8a8'")
        if self.needs_cpu_kernels and not cpu_kernels_available():
            raise ValueError(f"quantization {self.name!r} needs Loom's CPU kernels "
                             "(see loom.kernels.kernel_status())")

    def load_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the file's float tensors load in."""
        return dtype

    def weight_layout(self) -> str:
        """The int8 weight layout a prepared file records ("rows" or the kernels' "packed")."""
        return "rows"

    def blocks_hook(self, built: list[CausalLM], kept: dict[str, int]) -> BlocksHook | None:
        """The loader hook keeping file blocks this method computes from (None: none)."""
        return None

    def attach_kept_blocks(self, model: CausalLM, kept: dict[str, int]) -> None:
        """Rebuilding a prepared model's structure: give each module that kept its blocks
        shape-less blocks of that type, so preparation makes the same layers."""

    def prepare_layer(self, module: nn.Module) -> None:
        """Stack the projections of `module` (a decoder layer or a whole model) and quantise
        its linear layers; idempotent."""
        fuse_projections(module)

    def output_projection(self, head: nn.Module) -> nn.Module:
        """An untied output projection, prepared as soon as it has loaded."""
        return head

    def prepare_model(self, model: CausalLM, compact_embedding: bool | None) -> None:
        """Every step after loading: the layers (`prepare_layer`; those prepared while
        loading are left as they are), the output projection and the embedding.
        `compact_embedding`: what a prepared file recorded (None: decide from the values)."""
        self.prepare_layer(model)


class Int8Method(QuantMethod):
    """Per-output-channel int8 weights ("int8": float activations)."""

    name = "int8"

    def load_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32  # quantised from float32 values

    def stack(self, parts: list[nn.Module]) -> nn.Module:
        """One int8 layer of the stacked parts' outputs (rows quantised before stacking)."""
        return Int8Linear.stacked(parts, self.int8_activations)

    def quantize_linear(self, linear: nn.Module) -> nn.Module:
        """The int8 layer of one float linear layer."""
        return Int8Linear(linear.weight, linear.bias, self.int8_activations)

    def prepare_layer(self, module: nn.Module) -> None:
        fuse_projections(module, self.stack)
        quantize_model_int8(module, first=self.quantize_linear)

    def output_projection(self, head: nn.Module) -> nn.Module:
        return self.quantize_linear(head)

    def prepare_model(self, model: CausalLM, compact_embedding: bool | None) -> None:
        self.prepare_layer(model)
        _compact_embedding(model, compact_embedding)


class W8A8Method(Int8Method):
    """int8 weights and activations (per block of 32), packed for the CPU kernels."""

    name = "w8a8"
    int8_activations = True

    def weight_layout(self) -> str:
        return "packed" if cpu_kernels_available() else "rows"


class W4A8Method(W8A8Method):
    """A GGUF's K-quant matrices computed from the file's blocks; the rest as w8a8."""

    name = "w4a8"
    needs_cpu_kernels = True
    # A tensor-parallel rank keeps only its part of each tensor's blocks: its rows, or its
    # columns where they fall on block boundaries (else its part of the values, w8a8).
    shards = True
    # Every call, prefill included, computes from the file's blocks.
    large_batch_dtypes = False

    def blocks_hook(self, built: list[CausalLM], kept: dict[str, int]) -> BlocksHook:
        """The file blocks of every tensor the kernel computes are kept on the module that
        owns the tensor (BLOCKS_ATTRIBUTE) until its layer is prepared; `kept` records each
        such module's block type (what a warm start's structure needs). `built` holds the
        model once it is constructed (the hook runs while it loads)."""

        def keep(hf_name: str, type_id: int, blocks: Callable[[], torch.Tensor]) -> bool:
            if type_id not in W4A8_TYPES or not built:
                return False
            model = built[0]
            name = model.map_weight_name(hf_name)
            if name is None or not name.endswith(".weight"):
                return False
            owner_name = name.rpartition(".")[0]
            owner = model.get_submodule(owner_name)
            if not getattr(owner, "keeps_file_blocks", True):  # a MoE router: float values
                return False
            if not computable(type_id, int(owner.weight.shape[1])):
                return False
            raw = blocks()
            rule = model.weight_shards.get(name)
            if rule is not None:  # a tensor-parallel rank: its part of the blocks only
                part = shard_blocks(raw, type_id, rule)
                if part is None:
                    return False
                raw = part
            elif name == "model.embed_tokens.weight" and model.lm_head_from_embedding:
                # A rank's slice of a tied output projection: its rows of these blocks
                # (the loader then gives it no values, and it is prepared as it fills).
                head = shard_blocks(raw, type_id, model.weight_shards["lm_head.weight"])
                setattr(model.lm_head, BLOCKS_ATTRIBUTE, GGUFBlocks(type_id, head))
                kept["lm_head"] = type_id
            setattr(owner, BLOCKS_ATTRIBUTE, GGUFBlocks(type_id, raw))
            kept[owner_name] = type_id
            # Every module that holds computable blocks is built from them, or (a stack with
            # a part the kernel cannot compute) has its values decoded from them.
            return True

        return keep

    def attach_kept_blocks(self, model: CausalLM, kept: dict[str, int]) -> None:
        for name, type_id in kept.items():
            setattr(model.get_submodule(name), BLOCKS_ATTRIBUTE,
                    GGUFBlocks(int(type_id), torch.empty(0, dtype=torch.uint8, device="meta")))

    def stack(self, parts: list[nn.Module]) -> nn.Module:
        """From the file's blocks, or, where the kernel cannot compute every part, w8a8 over
        the parts' values (decoded from the blocks where they were kept)."""
        made = W4A8Linear.from_linears(parts)
        if made is not None:
            return made
        for part in parts:
            _values_from_blocks(part)
        return super().stack(parts)

    def quantize_linear(self, linear: nn.Module) -> nn.Module:
        return W4A8Linear.from_linears([linear]) or super().quantize_linear(linear)

    def prepare_model(self, model: CausalLM, compact_embedding: bool | None) -> None:
        embedding = model.model.embed_tokens
        if model.tie_embeddings and isinstance(model.lm_head, nn.Linear):
            # The tied output projection computes from the embedding's blocks.
            blocks = getattr(embedding, BLOCKS_ATTRIBUTE, None)
            if blocks is not None:
                setattr(model.lm_head, BLOCKS_ATTRIBUTE, blocks)
        self.prepare_layer(model)
        if isinstance(embedding, nn.Embedding):
            # Lookups from the file's blocks (shared with a tied output projection).
            head = model.lm_head if isinstance(model.lm_head, W4A8Linear) else None
            packed = W4A8Embedding.from_embedding(embedding,
                                                  head if model.tie_embeddings else None)
            if packed is not None:
                model.model.embed_tokens = embedding = packed
        if hasattr(embedding, BLOCKS_ATTRIBUTE):
            delattr(embedding, BLOCKS_ATTRIBUTE)
        _compact_embedding(model, compact_embedding)


QUANT_METHODS: dict[str, QuantMethod] = {
    method.name: method for method in (Int8Method(), W8A8Method(), W4A8Method())
    if method.name is not None
}
# The mode names `quantization=` accepts besides None / "none" and "auto".
QUANTIZATIONS = tuple(QUANT_METHODS)
FLOAT = QuantMethod()


def get_quant_method(name: str | None) -> QuantMethod:
    """The method of a mode name (None: exact float); ValueError for an unknown one."""
    if name is None:
        return FLOAT
    method = QUANT_METHODS.get(name)
    if method is None:
        raise ValueError(f"unsupported quantization {name!r}; known: {QUANTIZATIONS}")
    return method


def _values_from_blocks(linear: nn.Module) -> None:
    """Give a linear layer whose loader skipped its values (its blocks are kept) the file's
    values, decoded from the blocks (the same bits the loader would have yielded)."""
    blocks = getattr(linear, BLOCKS_ATTRIBUTE, None)
    if blocks is None or blocks.raw.is_meta:
        return
    values = torch.empty(tuple(linear.weight.shape), dtype=torch.float32)
    if not dequantize_gguf_blocks(blocks.raw.numpy(), blocks.type_id, values):
        raise RuntimeError(f"cannot decode GGUF blocks of type {blocks.type_id}")
    linear.weight = nn.Parameter(values, requires_grad=False)


def _compact_embedding(model: CausalLM, decided: bool | None) -> None:
    """In int8 modes the output projection holds its own int8 copy, so the embedding table
    only serves lookups: keep it as int8 blocks where that is exact (a GGUF Q8_0 table:
    671 MB -> 178 MB for the default model). `decided`: True/False when rebuilding a prepared
    model's structure, None to check the values."""
    embedding = model.model.embed_tokens
    if not isinstance(embedding, nn.Embedding) or decided is False:
        return
    if decided:
        rows, dim = embedding.weight.shape
        model.model.embed_tokens = BlockInt8Embedding(rows, dim, embedding.weight.dtype)
        return
    compact = BlockInt8Embedding.from_embedding(embedding)
    if compact is not None:
        model.model.embed_tokens = compact
