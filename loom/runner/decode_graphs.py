"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, over static buffers.

A step whose chunks are all single tokens (the steady state of generation) is launch-bound
on a GPU: a small model's forward is ~1,500 kernel launches and a few ms of GPU work. So such
steps run a graph captured at start-up for the smallest bucket (1, 2, 4, 8, 16, 24, 32, ...)
that holds the batch, padded with dummy rows. With speculative decoding a second runner does
the same for verification steps, every sequence given T = k + 1 token slots (its last token
and up to k drafts, the rest padding):

    static buffers (one device tensor, views per field; slots past a sequence's tokens and
    sequences past the batch are padding)
        input_ids [B*T]  positions [B*T]  slot_mapping [B*T]  logit_rows [B*T]
        seq_lens [B]     real_lens [B]    block_tables [B, M]
    per step: fill the pinned host copy, one non-blocking copy to the device, replay, and
    gather the real tokens' logits rows.

Sequence i owns token slots [i*T, (i+1)*T); its chunk of n <= T tokens fills the first n at
positions start..start+n-1 and padding tokens continue the positions, so the kernels see a
chunk of T tokens ending at start + T, of which `real_lens[i]` = n are real (0 for a padding
sequence): the attention kernel computes only those and reads keys only up to the last, so
nothing reads a slot no step wrote. Padding tokens write their K/V to the pad block, a block
the runner allocates past the pool (the block pool never hands it out), and the table
entries past a sequence's blocks point there too, so padding writes nothing a sequence owns. The
attention plan (work items, key parts) of each bucket is fixed at capture, which the Triton
backend's kernels allow: their launch shapes depend on nothing else.

Where CUDA graphs are unavailable (the CPU, in tests) `capture=False` keeps the same buffers,
padding and plans and calls the forward eagerly instead of replaying, so everything but the
capture itself is exercised by the CPU suite.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from loom.attention import AttentionMetadata, forward_context
from loom.attention.triton_backend import TritonAttentionBackend
from loom.core.scheduler_output import ScheduledChunk
from loom.models.base import CausalLM
from loom.models.config import ModelConfig

logger = logging.getLogger("loom")

# Fields of the static int64 buffer with one entry per token slot, then per sequence;
# block_tables follows them.
_TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping", "logit_rows")
_SEQ_FIELDS = ("seq_lens", "real_lens")


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
    """Runs steps of up to max(sizes) sequences of at most `tokens_per_seq` tokens each, all
    needing every token's logits (decodes: 1 token; verification: the last token and its
    drafts), from per-bucket graphs."""

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
        tokens_per_seq: int = 1,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.pad_block = pad_block
        self.sizes = sorted(sizes)
        self.capture_graphs = capture
        self.tokens_per_seq = tokens_per_seq
        self.max_blocks = -(-max_model_len // block_size)
        # Table columns past a sequence's last block that padding tokens may reach.
        self._spare_cols = -(-tokens_per_seq // block_size) + 1
        device = kv_caches[0].device
        self.device = device
        batch = self.sizes[-1]
        slots = batch * tokens_per_seq
        self._widths = [slots] * len(_TOKEN_FIELDS) + [batch] * len(_SEQ_FIELDS)
        self._table_cols = self.max_blocks + self._spare_cols
        width = sum(self._widths) + batch * self._table_cols
        self._host = torch.zeros(width, dtype=torch.int64, pin_memory=device.type == "cuda")
        # The host fields as numpy views of the same memory (element writes from Python are
        # ~10x cheaper there than on tensors), made once.
        self._host_fields = self._views(self._host.numpy())
        self._device = torch.zeros(width, dtype=torch.int64, device=device)
        (self._input_ids, self._positions, self._slots, self._rows, self._seq_lens,
         self._real_lens, self._tables) = self._views(self._device)
        self._query_start = torch.arange(batch + 1, dtype=torch.int64, device=device)
        self._query_start *= tokens_per_seq
        self._group = model_config.num_heads // model_config.num_kv_heads
        self._num_kv_heads = model_config.num_kv_heads
        self._max_model_len = max_model_len
        self._steps: dict[int, Callable[[], torch.Tensor]] = {}
        self._pool: object | None = None
        self._graph_inputs: list[object] = []  # what the captured graphs read; see _prepare
        self.steps_run = 0  # steps served from the buckets (a statistic)
        # Marks when the last step's inputs left the pinned host buffer (CUDA only): the
        # next step waits for it before rewriting the buffer.
        self._copied = torch.cuda.Event() if capture else None

    def _views(self, buffer: Any) -> tuple[Any, ...]:
        """The fields of the static buffer (the device tensor, or the host copy as a numpy
        array), in _TOKEN_FIELDS, _SEQ_FIELDS order, then the block tables [B, columns]."""
        fields, at = [], 0
        for width in self._widths:
            fields.append(buffer[at:at + width])
            at += width
        tables = buffer[at:].reshape(self.sizes[-1], self._table_cols)
        return (*fields, tables)

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
        from loom.kernels.triton_attention import AttentionPlan, block_q_for, launch_for

        tokens = size * self.tokens_per_seq
        md = AttentionMetadata(
            slot_mapping=self._slots[:tokens], positions=self._positions[:tokens],
            query_start_loc=self._query_start[:size + 1], seq_lens=self._seq_lens[:size],
            block_tables=self._tables[:size], block_size=self.block_size,
            query_lens_list=[self.tokens_per_seq] * size,
            seq_lens_list=[self._max_model_len] * size,
        )
        # Slots for the parts of the longest context a graph serves; each sequence spreads
        # its own parts over the bucket's programs (the cut is fixed, so a row's bits do
        # not depend on how many there are).
        part_keys = self.backend.part_keys
        programs, parts = launch_for(self.backend.split, size, self._num_kv_heads,
                                     self._max_model_len, self.backend.target_programs,
                                     part_keys)
        plan = AttentionPlan(  # one work item per sequence, covering its token slots
            work_seq=torch.arange(size, dtype=torch.int32, device=self.device),
            work_qoff=torch.zeros(size, dtype=torch.int32, device=self.device),
            block_q=block_q_for(self.tokens_per_seq, self._group), num_programs=programs,
            num_parts=parts, real_lens=self._real_lens[:size], part_keys=part_keys,
        )
        assert plan.block_q >= self.tokens_per_seq
        md.plan_cache[self.backend.plan_key(self._group, self._num_kv_heads)] = plan
        return md

    def _prepare(self, size: int) -> Callable[[], torch.Tensor]:
        md = self._metadata(size)
        plans = dict(md.plan_cache)
        tokens = size * self.tokens_per_seq
        ids, positions = self._input_ids[:tokens], self._positions[:tokens]

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

        # A graph holds raw addresses, not tensors: every tensor it reads that was made
        # outside it (the plan's work items above all) must live as long as the graph, or the
        # allocator hands its memory to a later step and the replay reads that step's data
        # (on an H100: a wrong first token, then an illegal address).
        self._graph_inputs.append((md, plans))

        def replay() -> torch.Tensor:
            graph.replay()
            # The graph writes the same output tensor on every replay; callers keep rows
            # (a session's last logits), so they get a copy.
            return logits.clone()

        return replay

    # ---- steps -----------------------------------------------------------------------------

    def applies(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether a graph can run these chunks: at most tokens_per_seq tokens each, every
        one needing its logits row, no more sequences than the largest bucket, contexts
        within max_model_len."""
        return (
            bool(self._steps)
            and 0 < len(chunks) <= self.sizes[-1]
            and all(0 < len(c.token_ids) <= self.tokens_per_seq
                    and c.num_logits == len(c.token_ids)
                    and len(c.block_ids) <= self.max_blocks for c in chunks)
        )

    def bucket(self, batch: int) -> int:
        """The smallest captured size that holds `batch` sequences."""
        return next(s for s in self.sizes if s >= batch)

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits [tokens, V] of the chunks' tokens in order (check `applies` first)."""
        size = self.bucket(len(chunks))
        if self._copied is not None:
            # Usually long done (the last step's tokens came back); not so after a step that
            # only stored logits (a one-token session prefill), which copied nothing back.
            self._copied.synchronize()
        num_rows = self._write_chunks(chunks)
        self._write_padding(len(chunks), size)
        self._device.copy_(self._host, non_blocking=True)  # the step's one input copy
        if self._copied is not None:
            self._copied.record()
        self.steps_run += 1
        logits = self._steps[size]()
        if self.tokens_per_seq == 1:
            return logits[:num_rows]
        return logits.index_select(0, self._rows[:num_rows])

    def _write_chunks(self, chunks: list[ScheduledChunk]) -> int:
        """Fill the host buffer's rows of the chunks; returns how many logits rows they need."""
        ids, positions, slots, rows, seq_lens, real_lens, tables = self._host_fields
        bs, per_seq = self.block_size, self.tokens_per_seq
        pad_slot = self.pad_block * bs
        num_rows = 0
        for i, c in enumerate(chunks):
            first = i * per_seq
            for j in range(per_seq):
                pos = c.start_pos + j
                positions[first + j] = pos
                if j < len(c.token_ids):
                    ids[first + j] = c.token_ids[j]
                    slots[first + j] = c.block_ids[pos // bs] * bs + pos % bs
                    rows[num_rows] = first + j
                    num_rows += 1
                else:  # padding: its K/V go to the pad block
                    ids[first + j] = 0
                    slots[first + j] = pad_slot + j % bs
            seq_lens[i] = c.start_pos + per_seq
            real_lens[i] = len(c.token_ids)
            n = len(c.block_ids)
            tables[i, :n] = c.block_ids
            tables[i, n:n + self._spare_cols] = self.pad_block
        return num_rows

    def _write_padding(self, start: int, end: int) -> None:
        """Sequences [start, end): padding tokens at positions 0.. in the pad block."""
        ids, positions, slots, _, seq_lens, real_lens, tables = self._host_fields
        per_seq, bs = self.tokens_per_seq, self.block_size
        lo, hi = start * per_seq, end * per_seq
        offsets = np.arange(hi - lo) % per_seq
        ids[lo:hi] = 0
        positions[lo:hi] = offsets
        slots[lo:hi] = self.pad_block * bs + offsets % bs
        seq_lens[start:end] = per_seq
        real_lens[start:end] = 0  # attention skips them entirely
        tables[start:end, : self._spare_cols] = self.pad_block
