"""Pure-torch reference attention over a paged KV cache (CPU and any device)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loom.attention.backend import AttentionBackend, AttentionSpec
from loom.attention.metadata import AttentionMetadata


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store k/v [T, Hkv, D] at flat slots [T] of a [2, blocks, block_size, Hkv, D] cache."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(kv_cache.dtype))


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked attention: q [N, H, M, D], k/v [N, Hkv, L, D], mask [N, 1, M, L] (True = see).

    `mask=None` means top-left causal (M == L, query i sees keys <= i). `sinks` [H]: a logit
    per query head that joins each row's softmax with no value (`AttentionSpec.sinks`).
    """
    n, num_heads, m, d = q.shape
    num_kv_heads, length = k.shape[1], k.shape[2]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
    if mask is None:
        mask = torch.ones(m, length, dtype=torch.bool, device=q.device).tril().view(1, 1, m, length)
    group = num_heads // num_kv_heads
    # Query head h reads kv head h // group: fold the group into the query axis.
    qg = q.reshape(n, num_kv_heads, group * m, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(n, num_kv_heads, group, m, length)
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        # One more column per row, the head's sink: [..., L] -> [..., L + 1], then dropped.
        sink = sinks.float().view(1, num_kv_heads, group, 1, 1).expand(n, -1, -1, m, 1)
        joined = torch.cat((scores.float(), sink), dim=-1)
        probs = torch.softmax(joined, dim=-1)[..., :length]
    probs = probs.to(q.dtype)
    out = torch.matmul(probs.reshape(n, num_kv_heads, group * m, length), v)
    return out.view(n, num_heads, m, d)


@dataclass(frozen=True)
class _DecodePlan:
    """Gather indices for a batch of single-token sequences (shared by all layers of a step)."""

    token_idx: torch.Tensor  # [n] packed token index of each decode query
    block_ids: torch.Tensor  # [n, nb] cache blocks covering each sequence's visible keys
    mask: torch.Tensor  # [n, 1, 1, nb * block_size] key visible to the query


class TorchAttentionBackend(AttentionBackend):
    """Reference backend: batched gather for decodes, one SDPA call per prefill chunk."""

    name = "torch"

    def forward(
        self,
        spec: AttentionSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Store k/v, then attend each sequence causally over its cached context."""
        write_kv(kv_cache, k, v, metadata.slot_mapping)
        out = torch.empty_like(q)
        q_lens = metadata.query_lens_list
        decodes = [b for b, n in enumerate(q_lens) if n == 1]
        if decodes:
            self._decode_rows(spec, q, kv_cache, metadata, decodes, out)
        token_start = 0
        for b, n in enumerate(q_lens):
            if n > 1:
                rows = slice(token_start, token_start + n)
                out[rows] = self._prefill(spec, q[rows], kv_cache, metadata, b)
            token_start += n
        return out.flatten(1)

    def _decode_rows(
        self,
        spec: AttentionSpec,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        decodes: list[int],
        out: torch.Tensor,
    ) -> None:
        """Write into `out` the attention of every single-token sequence (index in `decodes`)."""
        plan = self._decode_plan(md, decodes, spec.sliding_window)
        out[plan.token_idx] = self._decode(spec, q, kv_cache, plan, md.block_size)

    def _decode_plan(
        self, md: AttentionMetadata, decodes: list[int], window: int | None
    ) -> _DecodePlan:
        key = ("decode", window)
        plan = md.plan_cache.get(key)
        if isinstance(plan, _DecodePlan):
            return plan
        bs = md.block_size
        device = md.block_tables.device
        starts = [0]
        for n in md.query_lens_list[:-1]:
            starts.append(starts[-1] + n)
        seq_lens = [md.seq_lens_list[b] for b in decodes]
        # The single query sits at position seq_len - 1; keys [lo, seq_len) are visible.
        lows = [max(0, s - window) if window else 0 for s in seq_lens]
        first_blk = [lo // bs for lo in lows]
        num_blk = max(-(-s // bs) - f for s, f in zip(seq_lens, first_blk, strict=True))
        rows = torch.tensor(decodes, dtype=torch.int64, device=device)
        first = torch.tensor(first_blk, dtype=torch.int64, device=device)
        cols = (first[:, None] + torch.arange(num_blk, device=device)).clamp_(
            max=md.block_tables.shape[1] - 1
        )
        block_ids = md.block_tables[rows[:, None], cols]
        key_pos = first[:, None] * bs + torch.arange(num_blk * bs, device=device)
        seq_t = torch.tensor(seq_lens, dtype=torch.int64, device=device)
        low_t = torch.tensor(lows, dtype=torch.int64, device=device)
        mask = (key_pos < seq_t[:, None]) & (key_pos >= low_t[:, None])
        plan = _DecodePlan(
            token_idx=torch.tensor([starts[b] for b in decodes], dtype=torch.int64, device=device),
            block_ids=block_ids,
            mask=mask[:, None, None, :],
        )
        md.plan_cache[key] = plan
        return plan

    def _decode(
        self,
        spec: AttentionSpec,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: _DecodePlan,
        block_size: int,
    ) -> torch.Tensor:
        n, num_blk = plan.block_ids.shape
        length = num_blk * block_size
        # [n, nb, bs, Hkv, D] -> [n, Hkv, L, D]
        # Caches may be stored in a narrower dtype than q (kv_cache_dtype): attend in q's.
        keys = kv_cache[0][plan.block_ids].view(n, length, spec.num_kv_heads, spec.head_dim)
        vals = kv_cache[1][plan.block_ids].view(n, length, spec.num_kv_heads, spec.head_dim)
        keys, vals = keys.to(q.dtype), vals.to(q.dtype)
        qd = q[plan.token_idx].unsqueeze(2)  # [n, H, 1, D]
        out = attend(
            qd, keys.transpose(1, 2), vals.transpose(1, 2), plan.mask, spec.scale,
            spec.logit_softcap, spec.sinks,
        )
        return out.squeeze(2)

    def _prefill(
        self,
        spec: AttentionSpec,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        b: int,
    ) -> torch.Tensor:
        bs = md.block_size
        seq_len = md.seq_lens_list[b]
        q_len = q.shape[0]
        start = seq_len - q_len
        window = spec.sliding_window
        # Keys needed: [lo, seq_len), lo = first key the first query can see.
        lo = max(0, start - window + 1) if window else 0
        first_blk = lo // bs
        last_blk = -(-seq_len // bs)
        blocks = md.block_tables[b, first_blk:last_blk]
        key0 = first_blk * bs
        length = seq_len - key0
        keys = kv_cache[0][blocks].view(-1, spec.num_kv_heads, spec.head_dim)[:length]
        vals = kv_cache[1][blocks].view(-1, spec.num_kv_heads, spec.head_dim)[:length]
        keys, vals = keys.to(q.dtype), vals.to(q.dtype)
        mask: torch.Tensor | None = None
        if key0 != start or (window and window < q_len):
            q_pos = torch.arange(start, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(key0, seq_len, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if window:
                mask &= k_pos > q_pos - window
            mask = mask[None, None]
        out = attend(
            q.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            vals.transpose(0, 1).unsqueeze(0),
            mask, spec.scale, spec.logit_softcap, spec.sinks,
        )
        return out[0].transpose(0, 1)
