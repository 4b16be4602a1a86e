"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, over static buffers.

A step whose chunks are all single tokens (the steady state of generation) is launch-bound
on a GPU: a small model's forward is ~1,500 kernel launches and a few ms of GPU work. So such
steps run a graph captured at start-up for the smallest bucket (1, 2, 4, 8, 16, 24, 32, ...)
that holds the batch, padded with dummy rows:

    static buffers (one device tensor, views per field; rows past the batch are padding)
        input_ids [B]  positions [B]  slot_mapping [B]  seq_lens [B]  block_tables [B, M]
    per step: fill the pinned host copy, one non-blocking copy to the device, replay.

A padding row is a one-token sequence at position 0 whose K/V go to the pad block, a block
the runner allocates past the pool (the block pool never hands it out), so padding writes
nothing a sequence reads. The attention plan (work items, key parts) of each bucket is fixed
at capture, which the Triton backend's kernels allow: their launch shapes depend on nothing
else. Everything a graph reads that changes per step lives in the static buffers.

Where CUDA graphs are unavailable (the CPU, in tests) `capture=False` keeps the same buffers,
padding and plans and calls the forward eagerly instead of replaying, so everything but the
capture itself is exercised by the CPU suite.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from loom.attention import AttentionMetadata, forward_context
from loom.attention.triton_backend import TritonAttentionBackend
from loom.core.scheduler_output import ScheduledChunk
from loom.models.base import CausalLM
from loom.models.config import ModelConfig

logger = logging.getLogger("loom")

# Fields of the static int64 buffer, in order; block_tables follows them.
_FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens")


def graph_batch_sizes(max_num_seqs: int, requested: list[int] | None = None) -> list[int]:
    """The buckets: `requested` (sorted, deduplicated), else 1, 2, 4, 8 and then every
    multiple of 8, up to `max_num_seqs` (which is always a bucket)."""
    if requested:
        sizes = sorted({s for s in requested if 0 < s <= max_num_seqs})
        if not sizes:
            raise ValueError(f"cuda_graph_sizes {requested} has no size in [1, {max_num_seqs}]")
        return sizes
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


class DecodeGraphRunner:
    """Runs all-decode steps of up to max(sizes) sequences from per-bucket graphs."""

    def __init__(
        self,
        model: CausalLM,
        model_config: ModelConfig,
        kv_caches: list[torch.Tensor],
        backend: TritonAttentionBackend,
        block_size: int,
        pad_block: int,
        max_model_len: int,
        sizes: list[int],
        capture: bool,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.pad_block = pad_block
        self.sizes = sorted(sizes)
        self.capture_graphs = capture
        self.max_blocks = -(-max_model_len // block_size)
        device = kv_caches[0].device
        self.device = device
        batch = self.sizes[-1]
        width = len(_FIELDS) * batch + batch * self.max_blocks
        self._host = torch.zeros(width, dtype=torch.int64,
                                 pin_memory=device.type == "cuda")
        self._device = torch.zeros(width, dtype=torch.int64, device=device)
        views = {name: self._device[i * batch:(i + 1) * batch] for i, name in enumerate(_FIELDS)}
        self._input_ids, self._positions = views["input_ids"], views["positions"]
        self._slots, self._seq_lens = views["slot_mapping"], views["seq_lens"]
        self._tables = self._device[len(_FIELDS) * batch:].view(batch, self.max_blocks)
        self._query_start = torch.arange(batch + 1, dtype=torch.int64, device=device)
        self._group = model_config.num_heads // model_config.num_kv_heads
        self._num_kv_heads = model_config.num_kv_heads
        self._max_model_len = max_model_len
        self._steps: dict[int, Callable[[], torch.Tensor]] = {}
        self._pool: object | None = None
        self.steps_run = 0  # steps served from the buckets (a statistic)
        # Marks when the last step's inputs left the pinned host buffer (CUDA only): the
        # next step waits for it before rewriting the buffer.
        self._copied = torch.cuda.Event() if capture else None

    # ---- capture -------------------------------------------------------------------------

    def capture_all(self) -> None:
        """Capture (or, without graphs, prepare) every bucket, largest first so the smaller
        graphs share the largest one's memory pool; logs the time it took."""
        began = time.perf_counter()
        if self.capture_graphs:
            logger.info("capturing CUDA graphs for decode batches of %s sequences", self.sizes)
        self._write_padding(0, self.sizes[-1])
        self._device.copy_(self._host)
        for size in reversed(self.sizes):
            self._steps[size] = self._prepare(size)
        if self.capture_graphs:
            logger.info("captured %d CUDA graphs (batch sizes %s) in %.1f s", len(self.sizes),
                        self.sizes, time.perf_counter() - began)

    def _metadata(self, size: int) -> AttentionMetadata:
        from loom.kernels.triton_attention import AttentionPlan, parts_for

        md = AttentionMetadata(
            slot_mapping=self._slots[:size], positions=self._positions[:size],
            query_start_loc=self._query_start[:size + 1], seq_lens=self._seq_lens[:size],
            block_tables=self._tables[:size], block_size=self.block_size,
            query_lens_list=[1] * size, seq_lens_list=[self._max_model_len] * size,
        )
        # Parts sized for the longest context: each sequence splits its own keys into
        # that many, so a short one is split as finely as a long one.
        parts = self.backend.num_parts or parts_for(
            size, self._num_kv_heads, self._max_model_len, self.backend.target_programs)
        plan = AttentionPlan(
            work_seq=torch.arange(size, dtype=torch.int32, device=self.device),
            work_qoff=torch.zeros(size, dtype=torch.int32, device=self.device),
            block_q=1, num_parts=parts,
        )
        md.plan_cache[self.backend.plan_key(self._group, self._num_kv_heads)] = plan
        return md

    def _prepare(self, size: int) -> Callable[[], torch.Tensor]:
        md = self._metadata(size)
        plans = dict(md.plan_cache)
        ids, positions = self._input_ids[:size], self._positions[:size]

        def forward() -> torch.Tensor:
            # Layers memoise per-step values (rotary tables) in plan_cache: start each run
            # from the attention plan alone, so they are computed from this step's buffers
            # (and, when capturing, inside the graph rather than taken from the warmup).
            md.plan_cache.clear()
            md.plan_cache.update(plans)
            with torch.inference_mode(), forward_context(md, self.kv_caches, self.backend):
                return self.model.compute_logits(self.model(ids, positions))

        if not self.capture_graphs:
            return forward
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (allocator, autotuning) off the capture
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = forward()
        self._pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            # The graph writes the same output tensor on every replay; callers keep rows
            # (a session's last logits), so they get a copy.
            return logits.clone()

        return replay

    # ---- steps -----------------------------------------------------------------------------

    def applies(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether a graph can run these chunks: one new token and one logit row each, no
        more sequences than the largest bucket, contexts within max_model_len."""
        return (
            bool(self._steps)
            and 0 < len(chunks) <= self.sizes[-1]
            and all(len(c.token_ids) == 1 and c.num_logits == 1
                    and len(c.block_ids) <= self.max_blocks for c in chunks)
        )

    def bucket(self, batch: int) -> int:
        """The smallest captured size that holds `batch` sequences."""
        return next(s for s in self.sizes if s >= batch)

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits [len(chunks), V] of an all-decode step (check `applies` first)."""
        size = self.bucket(len(chunks))
        if self._copied is not None:
            # Usually long done (the last step's tokens came back); not so after a step that
            # only stored logits (a one-token session prefill), which copied nothing back.
            self._copied.synchronize()
        self._write_chunks(chunks)
        self._write_padding(len(chunks), size)
        self._device.copy_(self._host, non_blocking=True)  # the step's one input copy
        if self._copied is not None:
            self._copied.record()
        self.steps_run += 1
        return self._steps[size]()[: len(chunks)]

    def _host_views(self) -> tuple[torch.Tensor, ...]:
        batch = self.sizes[-1]
        fields = [self._host[i * batch:(i + 1) * batch] for i in range(len(_FIELDS))]
        tables = self._host[len(_FIELDS) * batch:].view(batch, self.max_blocks)
        return (*fields, tables)

    def _write_chunks(self, chunks: list[ScheduledChunk]) -> None:
        ids, positions, slots, seq_lens, tables = self._host_views()
        bs = self.block_size
        for row, c in enumerate(chunks):
            pos = c.start_pos
            ids[row] = c.token_ids[0]
            positions[row] = pos
            slots[row] = c.block_ids[pos // bs] * bs + pos % bs
            seq_lens[row] = pos + 1
            tables[row, : len(c.block_ids)] = torch.tensor(c.block_ids, dtype=torch.int64)

    def _write_padding(self, start: int, end: int) -> None:
        """Rows [start, end): one-token sequences at position 0 in the pad block."""
        ids, positions, slots, seq_lens, tables = self._host_views()
        ids[start:end] = 0
        positions[start:end] = 0
        slots[start:end] = self.pad_block * self.block_size
        seq_lens[start:end] = 1
        tables[start:end, 0] = self.pad_block
