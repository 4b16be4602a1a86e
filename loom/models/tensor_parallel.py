"""Megatron-style sharding of a decoder across the ranks of a tensor-parallel group.

Rank r of N keeps:

    q_proj, k_proj, v_proj   the rows of its attention heads (column-parallel)
    o_proj                   the columns of its heads (row-parallel: partial sums, all-reduced)
    gate_proj, up_proj       rows [r*I/N, (r+1)*I/N) of the intermediate size (column-parallel)
    down_proj                the same columns (row-parallel, all-reduced)
    experts                  each expert as a gated MLP above (its rows of every expert); the
                             router whole; one all-reduce of the block's weighted sum
    lm_head                  rows [r*Vp/N, (r+1)*Vp/N) of the vocabulary padded to Vp, a
                             multiple of N (the logits are gathered; padding rows are zero)
    everything else          whole: embedding, norms, rotary tables

Attention heads split evenly (num_heads % N == 0). KV heads split too where there are at least
N of them (num_kv_heads % N == 0); where there are fewer, N % num_kv_heads == 0 and each rank
keeps the one KV head its query heads read (replicated over N / num_kv_heads ranks). Each rank's
paged KV pool holds only its KV heads: `local_model_config` says how many.

`shard_model` reshapes a model built on the meta device before its weights load and records,
per parameter, which slice of the checkpoint tensor it holds (`CausalLM.weight_shards`);
`load_weights` cuts every tensor to that slice as it streams by, so no rank keeps more than its
shard (plus one whole tensor in flight). The projections are stacked and quantised after that,
per shard. `attach_collectives` then wraps the row-parallel projections and the output
projection in the group's all-reduce and all-gather (not part of the saved state).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from loom.attention import AttentionSpec, PagedAttention
from loom.errors import UnsupportedModelError
from loom.models.base import CausalLM
from loom.models.config import ModelConfig
from loom.models.layers import GatedMLP, Linear, SelfAttention
from loom.models.moe import SparseMoE
from loom.models.weight_shard import Shard, ShardRule

if TYPE_CHECKING:
    from loom.parallel.group import TensorParallelGroup


# Architectures with parameters no shard rule covers yet, and which.
_NOT_SHARDED = {
    "GptOssForCausalLM": "its attention sinks, expert biases and fused expert tensors",
    # Each rank holds its heads' share of q and k; the norm needs every head's.
    "OlmoeForCausalLM": "its QK-norms over all heads' features at once",
}


def check_shardable(config: ModelConfig, world_size: int) -> None:
    """Raise `UnsupportedModelError` naming the dimension that does not split `world_size`
    ways."""
    if world_size < 1:
        raise UnsupportedModelError(f"tensor_parallel_size must be >= 1, got {world_size}")
    if world_size > 1 and config.architecture in _NOT_SHARDED:
        raise UnsupportedModelError(
            f"{config.architecture} does not split over tensor-parallel ranks yet:"
            f" {_NOT_SHARDED[config.architecture]} have no shard rules")
    heads, kv = config.num_heads, config.num_kv_heads
    intermediate = int(config.text.get("intermediate_size") or 0)
    problems = []
    if heads % world_size:
        problems.append(f"{heads} attention heads")
    if kv % world_size and world_size % kv:
        problems.append(f"{kv} KV heads (neither a multiple nor a divisor of it)")
    if intermediate % world_size:
        problems.append(f"an intermediate size of {intermediate}")
    expert_width = int(config.text.get("moe_intermediate_size") or 0)
    if expert_width % world_size:
        problems.append(f"an expert width of {expert_width}")
    if problems:
        raise UnsupportedModelError(
            f"{config.architecture} cannot be split over tensor_parallel_size={world_size}: "
            f"{', '.join(problems)}"
        )


def local_model_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The model as one rank sees it: its attention and KV heads (what its KV pool holds)."""
    if world_size == 1:
        return config
    shard = Shard(0, world_size)
    kv_start, kv_stop = shard.kv_heads(config.num_heads, config.num_kv_heads)
    return dataclasses.replace(config, num_heads=config.num_heads // world_size,
                               num_kv_heads=kv_stop - kv_start)


def shard_model(model: CausalLM, shard: Shard) -> CausalLM:
    """Reshape `model` (built on the meta device, weights not loaded) into `shard`'s part and
    record the slices its parameters load (see the module docstring). A tied output
    projection becomes its own parameter, loaded from the embedding's rows."""
    check_shardable(model.config, shard.world_size)
    rules: dict[str, ShardRule] = {}
    for name, module in model.named_modules():
        if isinstance(module, SelfAttention):
            _shard_attention(name, module, shard, rules)
        elif isinstance(module, GatedMLP):
            _shard_mlp(name, module, shard, rules)
    vocab = model.config.vocab_size
    start, stop = shard.split(shard.padded_vocab(vocab))
    model.lm_head = _resized(model.lm_head, out_features=stop - start)
    rules["lm_head.weight"] = ShardRule(0, start, stop)
    if model.tie_embeddings:
        model.tie_embeddings = False
        model.lm_head_from_embedding = True
    model.weight_shards = rules
    model.use_fused_decode = False  # one C call for all layers leaves no room for all-reduces
    return model


def _shard_attention(prefix: str, attn: SelfAttention, shard: Shard,
                     rules: dict[str, ShardRule]) -> None:
    d = attn.head_dim
    q0, q1 = shard.split(attn.num_heads)
    kv0, kv1 = shard.kv_heads(attn.num_heads, attn.num_kv_heads)
    for proj, (start, stop) in (("q_proj", (q0, q1)), ("k_proj", (kv0, kv1)),
                                ("v_proj", (kv0, kv1))):
        linear = getattr(attn, proj)
        setattr(attn, proj, _resized(linear, out_features=(stop - start) * d))
        rules[f"{prefix}.{proj}.weight"] = ShardRule(0, start * d, stop * d)
        if linear.bias is not None:
            rules[f"{prefix}.{proj}.bias"] = ShardRule(0, start * d, stop * d)
    attn.o_proj = _resized(attn.o_proj, in_features=(q1 - q0) * d)
    rules[f"{prefix}.o_proj.weight"] = ShardRule(1, q0 * d, q1 * d)
    if attn.o_proj.bias is not None:
        rules[f"{prefix}.o_proj.bias"] = ShardRule(first_rank_only=True, rank=shard.rank)
    attn.num_heads, attn.num_kv_heads = q1 - q0, kv1 - kv0
    attn.qkv_sizes = ((q1 - q0) * d, (kv1 - kv0) * d, (kv1 - kv0) * d)
    spec: AttentionSpec = attn.attn.spec
    attn.attn = PagedAttention(attn.attn.layer_idx, dataclasses.replace(
        spec, num_heads=q1 - q0, num_kv_heads=kv1 - kv0))


def _shard_mlp(prefix: str, mlp: GatedMLP, shard: Shard, rules: dict[str, ShardRule]) -> None:
    start, stop = shard.split(mlp.down_proj.in_features)
    for proj in ("gate_proj", "up_proj"):
        setattr(mlp, proj, _resized(getattr(mlp, proj), out_features=stop - start))
        rules[f"{prefix}.{proj}.weight"] = ShardRule(0, start, stop)
    mlp.down_proj = _resized(mlp.down_proj, in_features=stop - start)
    rules[f"{prefix}.down_proj.weight"] = ShardRule(1, start, stop)


def _resized(linear: nn.Linear, *, in_features: int | None = None,
             out_features: int | None = None) -> Linear:
    """A Linear of the new shape with `linear`'s bias flag, dtype and device (meta: no
    memory)."""
    return Linear(in_features or linear.in_features, out_features or linear.out_features,
                  bias=linear.bias is not None, device=linear.weight.device,
                  dtype=linear.weight.dtype)


class RowParallelOutput(nn.Module):
    """A row-parallel projection: this rank's partial sums, all-reduced over the group."""

    def __init__(self, inner: nn.Module, group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The full projection of x (every rank gets the same sum)."""
        return self.group.all_reduce(self.inner(x))


class VocabParallelHead(nn.Module):
    """The output projection split by vocabulary: this rank's logits, gathered from every rank
    and cut to the real vocabulary."""

    def __init__(self, inner: nn.Module, group: TensorParallelGroup, vocab_size: int) -> None:
        super().__init__()
        self.inner = inner
        self.group = group
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, V] logits of the rows x [N, H] (the same on every rank)."""
        return self.group.all_gather_last_dim(self.inner(x))[..., : self.vocab_size]


def attach_collectives(model: CausalLM, group: TensorParallelGroup) -> CausalLM:
    """Wrap the row-parallel projections and the output projection of a sharded, prepared
    model in `group`'s collectives (runtime structure, never saved). A mixture of experts is
    reduced once, after its slot-weighted sum (a linear function of its experts' partial
    outputs), not once per expert it calls."""
    experts = {id(e) for m in model.modules() if isinstance(m, SparseMoE) for e in m.experts}
    for module in list(model.modules()):
        if isinstance(module, SelfAttention):
            module.o_proj = RowParallelOutput(module.o_proj, group)
        elif isinstance(module, GatedMLP) and id(module) not in experts:
            module.down_proj = RowParallelOutput(module.down_proj, group)
    for layer in model.model.layers:
        if isinstance(getattr(layer, "mlp", None), SparseMoE):
            layer.mlp = RowParallelOutput(layer.mlp, group)
    model.lm_head = VocabParallelHead(model.lm_head, group, model.config.vocab_size)
    return model
