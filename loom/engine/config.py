"""`EngineArgs` (what a user passes) and `EngineConfig` (what the engine runs with)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from loom.core.scheduler import SchedulerConfig
from loom.engine.kv_events import KVEventsConfig
from loom.spec_decode import SpeculativeConfig


@dataclass
class EngineArgs:
    """Every knob of the engine; `LLM(**kwargs)` accepts the same names."""

    model: str = "gemma3-270m"
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    # Tokens per step at most (prefill chunks + decodes); None: 512 on a CPU (a 512-token
    # chunk of the default model takes ~0.3 s there), 2048 on CUDA (vLLM's serving default:
    # an eager step is launch-bound, so TTFT at 2,048 tokens fell from 45 to 14 ms on an H100).
    max_num_batched_tokens: int | None = None
    # A time budget per step in milliseconds (None: off, the token budget alone): prefill
    # chunks are sized from a cost model of this engine on this host, fitted to the measured
    # steps, so that a step with running streams stays near it (their inter-token gap).
    # `loom serve` defaults it to 100 (0 there: off); offline runs keep whole chunks
    # (throughput).
    max_step_ms: float | None = None
    max_num_seqs: int = 64
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    block_size: int = 16
    # Full KV blocks are kept (hashed by their tokens) after their request ends and shared by
    # later requests, appended fragments and recomputes that start with the same tokens.
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    seed: int = 0
    session_ttl_s: float | None = 3600.0
    # "auto": the fastest mode that keeps quality here (a quantized GGUF runs "w4a8", its own
    # blocks, with a float16 KV cache on the CPU kernels; float checkpoints their dtype);
    # None / "none": exact dequantised float weights; "int8" / "w8a8" / "w4a8" force a mode
    # (loom.engine.mode).
    quantization: str | None = "auto"
    # "auto": float16 when quantization "auto" chose w4a8 (or w8a8), else the model dtype;
    # "float16" / "bfloat16" halve a float32 model's KV memory and the bytes decode attention
    # reads (CPU kernels read float16 natively).
    kv_cache_dtype: str = "auto"
    # "auto": prefill chunks and large batches compute with the same arithmetic as decode;
    # "bfloat16" multiplies them in bf16 (faster on CPUs with native bf16: AVX-512 BF16,
    # AMX; float32 activations on a CPU only), giving up bit-identical logits across
    # chunking, batching and caching; its KV is stored apart (loom.engine.mode).
    prefill_dtype: str = "auto"
    # Speculative decoding, vLLM's form: {"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_min": 2, "prompt_lookup_max": 4} (see loom.spec_decode.SpeculativeConfig).
    speculative_config: dict[str, Any] | None = None
    # A KV connector, vLLM's form: KVTransferConfig(kv_connector="SharedStorageConnector",
    # kv_role="kv_both", kv_connector_extra_config={"shared_storage_path": "kv"}) or the
    # same as a dict (see loom.kv_connector.KVTransferConfig).
    kv_transfer_config: Any = None
    # KV cache events in vLLM's wire format for KV-aware routers (llm-d, Dynamo, Ray), vLLM's
    # form: {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint":
    # "tcp://*:5558", "topic": "kv-events"}, a JSON string of it, or a KVEventsConfig (see
    # loom.engine.kv_events).
    kv_events_config: Any = None
    # Attention kernels: "auto" (the C kernels on CPU, Triton's on CUDA), "torch" (the
    # reference), "cpu", "triton" (on a CPU only under TRITON_INTERPRET=1, for tests).
    attention_backend: str = "auto"
    # With the triton backend, all-decode steps of up to max(cuda_graph_sizes) sequences run
    # from graphs captured at start-up (CUDA graphs on CUDA), one per batch-size bucket
    # (default 1, 2, 4, 8, 16, 24, ... max_num_seqs); enforce_eager=True runs every step
    # eagerly, as vLLM's flag does.
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    # On CUDA, the linear layers run Loom's Triton matmul, whose rows do not depend on the
    # batch (loom.kernels.triton_matmul), so a token's logits are the same bits whatever is
    # batched beside it and however its context reached the cache, as on the CPU kernels;
    # False runs cuBLAS, whose choice of algorithm by shape moves the last bits. (Attention
    # is batch invariant either way.) No effect on a CPU.
    batch_invariant: bool = True
    # Split the model over this many devices (processes), Megatron-style, on
    # torch.distributed (NCCL on CUDA, gloo on a CPU); see loom.parallel. Under torchrun
    # the ranks come from its environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE).
    tensor_parallel_size: int = 1
    special_kwargs: Any = None  # loom.engine.promise_sync.SpecialKwargs
    hooks: list[Any] = field(default_factory=list)  # loom.engine.hooks.SequenceHook objects

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Build from keyword arguments, rejecting unknown names with the list of known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)


@dataclass(frozen=True)
class EngineConfig:
    """The resolved configuration, composed once and never mutated."""

    model_path: Path
    tokenizer_path: Path
    dtype: str
    device: str
    scheduler: SchedulerConfig
    max_model_len: int
    seed: int
    session_ttl_s: float | None
    quantization: str | None  # resolved: None, "int8", "w8a8" or "w4a8"
    kv_cache_dtype: str  # resolved: the dtype name the KV pool is stored in
    speculative: SpeculativeConfig | None  # None: no speculative decoding
    # Model facts the engine needs (from the model's config, not the runner).
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    # The sizes an embedding may be cut to (`PoolingParams.dimensions`): empty unless the
    # model is a matryoshka model (loom.engine.pooling.allowed_dimensions).
    embedding_dimensions: tuple[int, ...] = ()
    kv_transfer: Any = None  # loom.kv_connector.KVTransferConfig, or None
    kv_cache_spec: Any = None  # loom.kv_connector.KVCacheSpec when kv_transfer is set
    kv_events: KVEventsConfig | None = None  # None: no KV cache events
    special_kwargs: Any = None
    hooks: tuple[Any, ...] = ()
    mode_summary: str = ""  # e.g. "w8a8, kv float16, cpu avx2" (the start-up line)
    tensor_parallel_size: int = 1

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.scheduler.block_size

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the KV pool."""
        return self.scheduler.num_kv_blocks
