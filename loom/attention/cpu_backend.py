"""CPU backend: decodes read the paged cache in place through Loom's C kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.attention.backend import AttentionSpec
from loom.attention.metadata import AttentionMetadata
from loom.attention.torch_backend import TorchAttentionBackend
from loom.kernels import KV_CACHE_KERNEL_DTYPES, paged_attention


@dataclass(frozen=True)
class _KernelDecodeRows:
    """Inputs of the decode kernel for one step (shared by all layers)."""

    token_idx: torch.Tensor | None  # packed row of each decode query; None = all rows, in order
    query_starts: torch.Tensor  # [S + 1] int64: 0, 1, ..., S (one query per sequence)
    block_tables: torch.Tensor  # [S, max_blocks] int64, contiguous
    seq_lens: torch.Tensor  # [S] int64
    max_seq_len: int


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch backend, with decode attention computed without gathering the context.

    Float32 queries over float32 or float16 caches on the CPU take the kernel; anything else
    (bf16) falls back to the torch decode path. Prefill chunks always use the torch path (one
    SDPA per chunk).
    """

    name = "cpu"

    def reads_only_written_slots(self, dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> bool:
        """True where decodes take the kernel (float32 queries, a cache dtype it reads): it
        and the prefill path read exactly the positions [first visible, seq_len) of each
        sequence (and so does the fused decoder, which runs only in this configuration)."""
        return dtype == torch.float32 and kv_cache_dtype in KV_CACHE_KERNEL_DTYPES

    def _decode_rows(
        self,
        spec: AttentionSpec,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        decodes: list[int],
        out: torch.Tensor,
    ) -> None:
        if (q.dtype != torch.float32 or kv_cache.dtype not in KV_CACHE_KERNEL_DTYPES
                or q.device.type != "cpu"):
            super()._decode_rows(spec, q, kv_cache, md, decodes, out)
            return
        rows = self._kernel_rows(md, decodes)
        queries = q if rows.token_idx is None else q[rows.token_idx]
        result = paged_attention(
            queries.contiguous(), rows.query_starts, kv_cache, rows.block_tables, rows.seq_lens,
            rows.max_seq_len, spec.scale, spec.sliding_window, spec.logit_softcap,
            sinks=None if spec.sinks is None else spec.sinks.float().contiguous(),
        )
        if rows.token_idx is None:
            out.copy_(result)
        else:
            out[rows.token_idx] = result

    @staticmethod
    def _kernel_rows(md: AttentionMetadata, decodes: list[int]) -> _KernelDecodeRows:
        cached = md.plan_cache.get("kernel_decode")
        if isinstance(cached, _KernelDecodeRows):
            return cached
        if len(decodes) == md.num_seqs:  # pure decode: one token per sequence, in order
            rows = _KernelDecodeRows(
                None, torch.arange(len(decodes) + 1), md.block_tables.contiguous(), md.seq_lens,
                max(md.seq_lens_list),
            )
        else:
            starts = [0]
            for n in md.query_lens_list[:-1]:
                starts.append(starts[-1] + n)
            index = torch.tensor(decodes, dtype=torch.int64)
            rows = _KernelDecodeRows(
                torch.tensor([starts[b] for b in decodes], dtype=torch.int64),
                torch.arange(len(decodes) + 1),
                md.block_tables[index].contiguous(),
                md.seq_lens[index].contiguous(),
                max(md.seq_lens_list[b] for b in decodes),
            )
        md.plan_cache["kernel_decode"] = rows
        return rows

