"""Turns scheduled chunks into tensors, runs the model, returns only the needed logits."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from loom.attention import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    TorchAttentionBackend,
    allocate_kv_caches,
    forward_context,
    get_attention_backend,
)
from loom.attention.triton_backend import TritonAttentionBackend, check_against_reference
from loom.core.scheduler_output import ScheduledChunk, SchedulerOutput
from loom.models.base import CausalLM
from loom.models.config import ModelConfig
from loom.runner.decode_graphs import DecodeGraphRunner
from loom.runner.host_memory import keep_freed_memory

logger = logging.getLogger("loom")

# Largest batch whose verification steps (speculative decoding) replay a graph: drafting
# pays at small batches, and each bucket keeps (batch x tokens) rows of logits.
_VERIFY_MAX_BATCH = 8


def kv_cache_bytes_per_block(
    model_config: ModelConfig, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes one KV block takes across all layers (K and V)."""
    per_layer = 2 * block_size * model_config.num_kv_heads * model_config.head_dim
    return model_config.num_layers * per_layer * dtype.itemsize


@dataclass(frozen=True)
class ModelOutput:
    """What one executed step hands back to the engine.

    `logits`: float32 [N, V], `chunk.num_logits` rows per chunk that needs logits, in chunk
    order. `load_errors`: block id -> why the connector could not load it. `load_failure`:
    why the whole external load failed (the connector raised), or None. `pooled`: float64
    [P, H], one row per pooling chunk in chunk order (`pool_rows`), or None without any."""

    logits: torch.Tensor
    load_errors: dict[int, str] = field(default_factory=dict)
    load_failure: str | None = None
    pooled: torch.Tensor | None = None


class ModelRunner:
    """Owns the paged KV caches and executes one step of scheduled chunks.

    `execute_model(SchedulerOutput) -> ModelOutput` is the engine's one call per step: block
    copies, external KV loads, the forward and the saves all happen inside it."""

    def __init__(
        self,
        model_config: ModelConfig,
        model: CausalLM,
        device: torch.device | str,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        attention_backend: str = "auto",
        kv_cache_dtype: torch.dtype | None = None,
        decode_graph_sizes: list[int] | None = None,
        max_model_len: int | None = None,
        verify_tokens: int | None = None,
    ) -> None:
        """`decode_graph_sizes`: run all-decode steps of up to that many sequences from
        per-bucket graphs over static buffers (loom.runner.decode_graphs), captured as CUDA
        graphs on CUDA; needs the triton attention backend and `max_model_len`; None: every
        step runs eagerly. `verify_tokens` (speculative decoding: 1 + the drafts per step)
        adds graphs for verification steps of up to _VERIFY_MAX_BATCH sequences."""
        self.model_config = model_config
        self.model = model
        self.device = torch.device(device)
        if self.device.type == "cpu":
            keep_freed_memory()  # per-step buffers from the heap, not fresh pages
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype  # K/V are stored in this dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.backend: AttentionBackend = get_attention_backend(attention_backend, device)
        if isinstance(self.backend, TritonAttentionBackend):
            self._check_triton(attention_backend)
        graphs = decode_graph_sizes if isinstance(self.backend, TritonAttentionBackend) else None
        # With graphs the pool has one block more than the block pool hands out: the pad
        # block, where a graph's padding rows write their K/V.
        self.kv_caches = allocate_kv_caches(
            model_config.num_layers, num_blocks + (1 if graphs else 0), block_size,
            model_config.num_kv_heads, model_config.head_dim, self.kv_cache_dtype, self.device,
            zeroed=not self.backend.reads_only_written_slots(dtype, self.kv_cache_dtype),
        )
        self.kv_connector: Any = None  # the worker half of a KV connector (loom.kv_connector)
        self.decode_graphs: DecodeGraphRunner | None = None
        self.verify_graphs: DecodeGraphRunner | None = None
        if graphs:
            assert isinstance(self.backend, TritonAttentionBackend) and max_model_len
            self.decode_graphs = DecodeGraphRunner(
                model, model_config, self.kv_caches, self.backend, block_size,
                pad_block=num_blocks, max_model_len=max_model_len, sizes=graphs,
                capture=self.device.type == "cuda",
            )
            self.decode_graphs.capture_all()
            verify_sizes = [n for n in graphs if n <= _VERIFY_MAX_BATCH] or graphs[:1]
            if verify_tokens and verify_tokens > 1:
                self.verify_graphs = DecodeGraphRunner(
                    model, model_config, self.kv_caches, self.backend, block_size,
                    pad_block=num_blocks, max_model_len=max_model_len, sizes=verify_sizes,
                    capture=self.device.type == "cuda", tokens_per_seq=verify_tokens,
                )
                self.verify_graphs.capture_all()

    def _check_triton(self, requested: str) -> None:
        """Check the Triton kernels on this device against the reference once; where they
        fail, "auto" falls back to the torch backend (no graphs) with a warning, and an
        explicit "triton" raises."""
        cfg = self.model_config
        windows = [None] + ([12] if cfg.sliding_window else [])  # 12: masks in the check
        problem = None
        for window in windows:
            spec = AttentionSpec(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                 cfg.head_dim ** -0.5, sliding_window=window)
            problem = problem or check_against_reference(
                self.backend, spec, self.device, self.dtype, self.kv_cache_dtype)
        if problem is None:
            return
        if requested == "triton":
            raise RuntimeError(f"the triton attention backend fails on {self.device}: {problem}")
        logger.warning("Triton attention fails on %s (%s): using the torch reference backend "
                       "and no CUDA graphs", self.device, problem)
        self.backend = TorchAttentionBackend()

    def attach_kv_connector(self, connector: Any) -> None:
        """Give the worker half of a KV connector the KV pool; each step then loads before
        and saves after the forward (`load_kv`, `save_kv`)."""
        connector.register_kv_caches(self.kv_caches)
        self.kv_connector = connector

    def load_kv(self, connector_metadata: Any) -> str | None:
        """Bind this step's connector metadata and load its blocks into the pool, every
        layer in place before the forward. Returns None, or why the connector raised (a
        user's connector may): then every load of this step counts as failed, and the
        requests that waited for it recompute or fail by their policy; nothing escapes into
        the step."""
        if self.kv_connector is None:
            return None
        try:
            self.kv_connector.bind_connector_metadata(connector_metadata)
            self.kv_connector.start_load_kv()
            for layer in range(len(self.kv_caches)):
                self.kv_connector.wait_for_layer_load(layer)
        except Exception as error:
            logger.warning("KV connector load failed: %s: %s", type(error).__name__, error)
            return f"the connector raised {type(error).__name__}: {error}"
        return None

    def save_kv(self, metadata: AttentionMetadata | None = None) -> dict[int, str]:
        """After the forward: save what the step filled; returns the step's load errors
        (block id -> cause) and unbinds the metadata. A connector that raises while saving
        leaves those blocks unsaved (logged); the step goes on."""
        connector = self.kv_connector
        if connector is None:
            return {}
        try:
            for layer, cache in enumerate(self.kv_caches):
                connector.save_kv_layer(layer, cache, metadata)
            connector.wait_for_save()
        except Exception as error:
            logger.warning("KV connector save failed: %s: %s", type(error).__name__, error)
        try:
            return dict(connector.get_load_errors())
        except Exception as error:
            logger.warning("KV connector load errors unreadable: %s: %s",
                           type(error).__name__, error)
            return {}
        finally:
            try:
                connector.clear_connector_metadata()
            except Exception as error:
                logger.warning("KV connector failed to unbind: %s: %s",
                               type(error).__name__, error)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        """Run one scheduled step: copy-on-write block copies, then the connector's loads,
        the forward of every chunk, and the connector's saves. A connector that raises
        never escapes (its loads count as failed, its saves are skipped); an error in the
        forward itself propagates: it concerns the whole step."""
        self.copy_blocks(scheduler_output.block_copies)
        load_failure = self.load_kv(scheduler_output.kv_connector_metadata)
        logits, pooled = self.execute_step(scheduler_output.chunks)
        load_errors = self.save_kv()
        return ModelOutput(logits, load_errors, load_failure, pooled)

    def shutdown(self) -> None:
        """Nothing to release on one device (the pool goes with the runner)."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV block src -> dst in every layer (copy-on-write of forked blocks)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            for cache in self.kv_caches:
                # cache: [2, num_blocks, ...]; gather first so overlapping pairs read old data.
                cache[:, dst] = cache[:, src]

    def build_metadata(self, chunks: list[ScheduledChunk]) -> AttentionMetadata:
        """Attention metadata (slots, positions, block tables, lengths) for the chunks."""
        for c in chunks:
            if not c.token_ids:
                raise ValueError(f"request {c.request_id}: empty chunk")
            if len(c.block_ids) * self.block_size < c.end_pos:
                raise ValueError(
                    f"request {c.request_id}: {len(c.block_ids)} blocks of {self.block_size} "
                    f"cannot hold {c.end_pos} positions"
                )
        return AttentionMetadata.build(
            start_pos=[c.start_pos for c in chunks],
            query_lens=[len(c.token_ids) for c in chunks],
            block_ids=[c.block_ids for c in chunks],
            block_size=self.block_size,
            device=self.device,
        )

    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Run the chunks; float32 logits [N, V]: `chunk.num_logits` rows per chunk (its last
        token, or the token before its drafts and each draft), in chunk order."""
        return self.execute_step(chunks)[0]

    def execute_step(self, chunks: list[ScheduledChunk]
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the chunks: their logits (see `execute`) and the pooling chunks' pooled rows
        (see `pool_rows`; None when no chunk pools)."""
        vocab = self.model_config.vocab_size
        if not chunks:
            return torch.empty((0, vocab), dtype=torch.float32, device=self.device), None
        if self.kv_connector is None:
            for graphs in (self.decode_graphs, self.verify_graphs):
                if graphs is not None and graphs.applies(chunks):  # never a pooling chunk
                    return graphs.run(chunks), None
        metadata = self.build_metadata(chunks)
        input_ids = torch.tensor(
            [t for c in chunks for t in c.token_ids], dtype=torch.int64
        ).to(self.device)
        # Rows of each chunk's last num_logits tokens in the packed batch, which ends the
        # chunk at query_start_loc[b + 1].
        last_rows: list[int] = []
        end = 0
        for c in chunks:
            end += len(c.token_ids)
            last_rows.extend(range(end - c.num_logits, end))
        with torch.inference_mode(), forward_context(metadata, self.kv_caches, self.backend):
            hidden = self.model(input_ids, metadata.positions)
            pooled = pool_rows(chunks, hidden)
            if not last_rows:
                return torch.empty((0, vocab), dtype=torch.float32, device=self.device), pooled
            rows = torch.tensor(last_rows, dtype=torch.int64, device=self.device)
            return self.model.compute_logits(hidden[rows]), pooled


def pool_rows(chunks: list[ScheduledChunk], hidden: torch.Tensor) -> torch.Tensor | None:
    """One float64 row [H] per pooling chunk, in chunk order, from the packed hidden states
    [T, H] (the model's output, after its final norm): "mean" chunks give the sum of their
    rows (the engine adds the chunks' sums and divides once, so chunking changes at most the
    float64 rounding of the sum), "last" chunks their last row (used only when the chunk
    ends the prompt). None when no chunk pools."""
    pooled: list[torch.Tensor] = []
    end = 0
    for c in chunks:
        start, end = end, end + len(c.token_ids)
        if c.pooling == "mean":
            pooled.append(hidden[start:end].double().sum(dim=0))
        elif c.pooling is not None:  # "last"
            pooled.append(hidden[end - 1].double())
    return torch.stack(pooled) if pooled else None
