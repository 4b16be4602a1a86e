"""Turn `EngineArgs` into a resolved `EngineConfig`, a loaded model runner and a tokenizer."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from loom.core.kv_cache_manager import cdiv
from loom.core.scheduler import SchedulerConfig
from loom.engine.config import EngineArgs, EngineConfig
from loom.engine.kv_events import KVEventsConfig
from loom.engine.mode import (
    ExecutionMode,
    HostInfo,
    choose_mode,
    normalize_dtype,
    normalize_quantization,
)
from loom.engine.pooling import allowed_dimensions
from loom.errors import InvalidRequestError
from loom.kernels import CUDA_INVARIANT_ARITHMETIC, KERNEL_ARITHMETIC, cpu_kernels_available
from loom.kv_connector import KVCacheSpec, KVTransferConfig, model_identity
from loom.kv_connector.factory import connector_class
from loom.loader import weights_are_quantized
from loom.loader.resolve import resolve_model_path
from loom.models.quant_method import get_quant_method
from loom.models.tensor_parallel import check_shardable, local_model_config
from loom.parallel.executor import launch as launch_tensor_parallel
from loom.runner.decode_graphs import graph_batch_sizes
from loom.runner.executor import Executor
from loom.runner.model_runner import kv_cache_bytes_per_block
from loom.runner.rank_runner import (
    TORCH_DTYPES,
    RunnerSpec,
    build_runner,
    read_model_config,
    torch_dtype,
)
from loom.spec_decode import SpeculativeConfig
from loom.tokenizer import Tokenizer, load_tokenizer

# Upper bound on pool size chosen from a memory budget (a tiny model would get millions).
_MAX_AUTO_BLOCKS = 16_384
logger = logging.getLogger("loom")


def resolve_device(device: str) -> str:
    """ "auto" picks CUDA when available, else CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


# max_num_batched_tokens when not given, per device type.
DEFAULT_STEP_TOKENS = {"cpu": 512, "cuda": 2048}


def resolve_step_tokens(args: EngineArgs, device: str) -> int:
    """The step's token budget: as given, else the device's default."""
    if args.max_num_batched_tokens is not None:
        return args.max_num_batched_tokens
    return DEFAULT_STEP_TOKENS.get(torch.device(device).type, 512)


def resolve_mode(args: EngineArgs, model_path: Path, device: str) -> tuple[ExecutionMode, str]:
    """dtype, quantization and KV dtype for this model on this host (see `loom.engine.mode`),
    validated, and the start-up line's description of them."""
    try:
        quantization = normalize_quantization(args.quantization)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    for name, value in (("dtype", args.dtype), ("kv_cache_dtype", args.kv_cache_dtype)):
        if normalize_dtype(value) not in (*TORCH_DTYPES, "auto"):
            raise InvalidRequestError(
                f"unsupported {name} {value!r}; choose 'auto' or one of {sorted(TORCH_DTYPES)}"
            )
    host = HostInfo.detect(device)
    quantized = quantization == "auto" and weights_are_quantized(model_path)
    try:  # a prefill_dtype this mode cannot use
        mode = choose_mode(args.dtype, quantization, args.kv_cache_dtype, quantized, host,
                           prefill_dtype=args.prefill_dtype)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    return mode, mode.describe(host)


def kv_arithmetic(device: str, attention_backend: str = "auto",
                  batch_invariant: bool = True) -> str:
    """Which kernels compute K/V on `device` (`KVCacheSpec.arithmetic`): Loom's C kernels
    (`KERNEL_ARITHMETIC`, bumped whenever a kernel change can move a bit) on a CPU where
    they load, Loom's batch-invariant matmul on CUDA (`CUDA_INVARIANT_ARITHMETIC`), else
    torch's ops ("torch-cpu", "torch-cuda"); followed by the attention backend asked for,
    which decides how steps outside the fused decoder attend."""
    kind = torch.device(device).type
    if kind == "cpu" and cpu_kernels_available():
        where = KERNEL_ARITHMETIC
    elif kind == "cuda" and batch_invariant:
        where = CUDA_INVARIANT_ARITHMETIC
    else:
        where = f"torch-{kind}"
    return f"{where}/{attention_backend}"


def resolve_speculative_config(
    value: dict[str, Any] | SpeculativeConfig | None,
) -> SpeculativeConfig | None:
    """`speculative_config` as given (a dict with vLLM's keys, or the dataclass), validated."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise InvalidRequestError(
            f"speculative_config must be a dict such as {{'method': 'ngram', "
            f"'num_speculative_tokens': 4}}, got {type(value).__name__}"
        )
    return SpeculativeConfig.from_dict(value)


def build_engine_parts(args: EngineArgs) -> tuple[EngineConfig, Executor, Tokenizer]:
    """Resolve paths, dtype and device, load the model, size the KV pool, load the tokenizer."""
    step_tokens = args.max_num_batched_tokens
    if args.block_size <= 0 or args.max_num_seqs <= 0 or (
            step_tokens is not None and step_tokens <= 0):
        raise InvalidRequestError(
            "block_size, max_num_batched_tokens and max_num_seqs must be positive"
        )
    model_path = resolve_model_path(args.model)
    tokenizer_path = resolve_model_path(args.tokenizer) if args.tokenizer else model_path
    # The tokenizer loads on a thread while the model loads here: parsing a large vocabulary
    # (Gemma's 262,144 tokens and 514,906 merges: about 1.7 s) runs in Rust without the GIL.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-tokenizer") as pool:
        tokenizer = pool.submit(load_tokenizer, tokenizer_path)
        config, runner = _build_model_parts(args, model_path, tokenizer_path)
        return config, runner, tokenizer.result()


def _build_model_parts(
    args: EngineArgs, model_path: Path, tokenizer_path: Path
) -> tuple[EngineConfig, Executor]:
    device = resolve_device(args.device)
    mode, mode_summary = resolve_mode(args, model_path, device)
    dtype, kv_dtype = mode.dtype, mode.kv_cache_dtype
    speculative = resolve_speculative_config(args.speculative_config)
    kv_transfer = None
    if args.kv_transfer_config is not None:
        kv_transfer = KVTransferConfig.coerce(args.kv_transfer_config)
        connector_class(kv_transfer)  # an unknown name or module fails before the model loads
    kv_events = None
    if args.kv_events_config is not None:
        kv_events = KVEventsConfig.coerce(args.kv_events_config)
    tp = args.tensor_parallel_size
    if not isinstance(tp, int) or tp < 1:
        raise InvalidRequestError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    if tp > 1 and not get_quant_method(mode.quantization).shards:
        raise InvalidRequestError(f"quantization {mode.quantization!r} does not shard over "
                                  "devices yet; use 'w8a8' with tensor_parallel_size > 1")
    model_config = read_model_config(model_path)
    check_shardable(model_config, tp)
    rank_config = local_model_config(model_config, tp)  # what each rank's KV pool holds
    if args.num_kv_blocks is not None:
        num_blocks = args.num_kv_blocks
    else:  # kv_cache_memory_gb is per device
        per_block = kv_cache_bytes_per_block(rank_config, args.block_size, torch_dtype(kv_dtype))
        num_blocks = min(_MAX_AUTO_BLOCKS, int(args.kv_cache_memory_gb * 2**30 // per_block))
    if num_blocks <= 0:
        raise InvalidRequestError(f"the KV pool must have at least one block, got {num_blocks}")
    max_model_len = min(
        args.max_model_len or model_config.max_position_embeddings,
        model_config.max_position_embeddings,
        num_blocks * args.block_size,
    )
    scheduler = SchedulerConfig(
        max_num_batched_tokens=resolve_step_tokens(args, device),
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=num_blocks,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        max_step_ms=args.max_step_ms or None,  # 0: off
    )
    if torch.device(device).type == "cuda" and args.batch_invariant:
        mode_summary += ", batch invariant"
    if tp > 1:
        mode_summary += f", tensor parallel {tp}"
    config = EngineConfig(
        model_path=model_path,
        tokenizer_path=tokenizer_path,
        dtype=dtype,
        device=device,
        scheduler=scheduler,
        max_model_len=max_model_len,
        seed=args.seed,
        session_ttl_s=args.session_ttl_s,
        quantization=mode.quantization,
        mode_summary=mode_summary,
        special_kwargs=args.special_kwargs,
        hooks=tuple(args.hooks),
        kv_cache_dtype=kv_dtype,
        speculative=speculative,
        vocab_size=model_config.vocab_size,
        eos_token_ids=tuple(model_config.eos_token_ids),
        embedding_dimensions=tuple(allowed_dimensions(model_config.hidden_size,
                                                      model_config.hf)),
        kv_transfer=kv_transfer,
        kv_cache_spec=None if kv_transfer is None else KVCacheSpec(
            model_id=model_identity(model_path), dtype=dtype, kv_cache_dtype=kv_dtype,
            block_size=args.block_size, num_layers=model_config.num_layers,
            num_kv_heads=rank_config.num_kv_heads, head_dim=model_config.head_dim,
            quantization=mode.quantization, large_batch_dtype=mode.large_batch_dtype,
            arithmetic=kv_arithmetic(device, args.attention_backend, args.batch_invariant),
            tensor_parallel_size=tp,
        ),
        tensor_parallel_size=tp,
        kv_events=kv_events,
    )
    assert cdiv(max_model_len, args.block_size) <= num_blocks
    graph_sizes = None if args.enforce_eager else graph_batch_sizes(
        args.max_num_seqs, args.cuda_graph_sizes)
    spec = RunnerSpec(
        model_path=model_path, dtype=dtype, device=device, quantization=mode.quantization,
        large_batch_dtype=mode.large_batch_dtype, kv_cache_dtype=kv_dtype,
        batch_invariant=args.batch_invariant, num_blocks=num_blocks,
        block_size=args.block_size, max_model_len=max_model_len,
        attention_backend=args.attention_backend,
        decode_graph_sizes=None if graph_sizes is None else tuple(graph_sizes),
        verify_tokens=None if speculative is None else speculative.num_speculative_tokens + 1,
        kv_transfer=kv_transfer, kv_cache_spec=config.kv_cache_spec,
        tensor_parallel_size=tp,
    )
    executor: Executor = build_runner(spec) if tp == 1 else launch_tensor_parallel(spec)
    logger.info("loaded %s (%s)", args.model, mode_summary)
    return config, executor
