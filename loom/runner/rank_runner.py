"""`RunnerSpec` and `build_runner`: what one rank builds its model runner from, and the build.

One device runs one runner built from the spec. Under tensor parallelism every rank builds its
runner from the same spec, with its own rank: its shard of the model, a KV pool of its KV
heads, its own worker half of a KV connector (keyed by rank), its device. The spec is plain
data: it crosses to worker processes pickled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from loom.kv_connector import KVConnectorRole, create_connector
from loom.loader import load_model_files
from loom.models.config import ModelConfig
from loom.models.layers import set_batch_invariant
from loom.models.quant import set_large_batch_dtype
from loom.models.tensor_parallel import attach_collectives, local_model_config
from loom.models.weight_shard import Shard
from loom.runner.loading import build_model, model_architecture
from loom.runner.model_runner import ModelRunner

if TYPE_CHECKING:
    from loom.parallel.group import TensorParallelGroup

# The dtypes a resolved mode names (`EngineConfig.dtype`, `kv_cache_dtype`, ...).
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a resolved dtype name."""
    return TORCH_DTYPES[name]


@dataclass(frozen=True)
class RunnerSpec:
    """Everything a rank needs to build its runner; dtypes by name (resolved already)."""

    model_path: Path
    dtype: str
    device: str  # the driver's device; on CUDA rank r uses cuda:<local rank>
    quantization: str | None
    large_batch_dtype: str | None
    kv_cache_dtype: str
    num_blocks: int
    block_size: int
    max_model_len: int
    attention_backend: str = "auto"
    decode_graph_sizes: tuple[int, ...] | None = None
    verify_tokens: int | None = None
    kv_transfer: Any = None  # loom.kv_connector.KVTransferConfig
    kv_cache_spec: Any = None  # loom.kv_connector.KVCacheSpec, rank 0's
    tensor_parallel_size: int = 1
    # CUDA: float linear layers on the batch-invariant matmul (EngineArgs.batch_invariant).
    batch_invariant: bool = False


def read_model_config(path: Path) -> ModelConfig:
    """The model's config from its files' headers (no weights read)."""
    return model_architecture(load_model_files(path).hf_config)[1]


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device rank `local_rank` (on its machine) of a tensor-parallel group computes on:
    GPU `local_rank` on CUDA, the CPU otherwise."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.device("cuda", local_rank)
    return dev


def build_runner(spec: RunnerSpec, rank: int = 0, local_rank: int = 0,
                 group: TensorParallelGroup | None = None) -> ModelRunner:
    """Load rank `rank`'s part of the model and build its runner (the whole model when
    `spec.tensor_parallel_size` is 1; `group` carries the collectives otherwise)."""
    world = spec.tensor_parallel_size
    device = rank_device(spec.device, local_rank) if world > 1 else torch.device(spec.device)
    shard = Shard(rank, world) if world > 1 else None
    model_config, model = build_model(spec.model_path, torch_dtype(spec.dtype), device,
                                      spec.quantization, shard=shard)
    if spec.large_batch_dtype is not None:
        set_large_batch_dtype(model, torch_dtype(spec.large_batch_dtype))
    if spec.batch_invariant and device.type == "cuda":
        set_batch_invariant(model)
    if group is not None:
        attach_collectives(model, group)
    local_config = local_model_config(model_config, world)
    runner = ModelRunner(
        local_config, model, device, torch_dtype(spec.dtype), spec.num_blocks, spec.block_size,
        attention_backend=spec.attention_backend,
        kv_cache_dtype=torch_dtype(spec.kv_cache_dtype),
        decode_graph_sizes=None if spec.decode_graph_sizes is None
        else list(spec.decode_graph_sizes),
        max_model_len=spec.max_model_len, verify_tokens=spec.verify_tokens,
    )
    if spec.kv_transfer is not None:
        kv_spec = spec.kv_cache_spec
        if world > 1:
            kv_spec = dataclasses.replace(kv_spec, tensor_parallel_rank=rank)
        runner.attach_kv_connector(
            create_connector(spec.kv_transfer, kv_spec, KVConnectorRole.WORKER))
    return runner
