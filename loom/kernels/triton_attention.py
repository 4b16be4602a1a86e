"""Paged attention in Triton: the CUDA attention kernels (Triton's interpreter runs them on CPU).

One kernel serves prefill chunks, decodes and speculative verification alike. A program
attends a tile of query rows -- up to `block_q` consecutive query tokens of one sequence,
times the GROUP query heads that read one kv head, so each key and value row is loaded once
for the whole group -- over keys read in place from the paged cache through its block table
(no gathered copy of the context):

    grid = (work items, kv heads, programs per item)
    work item w = (sequence work_seq[w], its query tokens [work_qoff[w], + block_q))

The keys are cut into parts at fixed positions, [p * part_keys, (p + 1) * part_keys), the
same for every row of every step. A row's result is defined as the fold, in increasing p,
of its parts' states (running max m, sum of exponentials l, unnormalised output acc), each
part's state computed from fresh over its whole BLOCK_N tiles:

    M, L, A = -inf, 0, 0
    for p in the row's parts:  M, L, A = fold(M, L, A, state(p))
    out = A / L

Two launches compute that fold. With one program per item (`num_programs == 1`: prefill
chunks, big batches) the program computes each part's state and folds it in as it goes.
Spread (decodes of few sequences, where one context is the only parallelism there is),
program j of P computes the item's parts j, j + P, ... and writes each one's state to its
slot, and `_merge_parts` folds each row's parts in the same order with the same
operations. A part the row cannot see is an exact no-op of the fold,
and the tile shape (`block_m` query rows, BLOCK_N keys, the head width) and warps are fixed
per model, so a row's output is the same bits whichever way it was launched, however many
rows share its tile and whatever else the step holds: the default mode's batch invariance
on the GPU. Both kernels compile without floating-point contraction, so the fold rounds
where it is written.

Masks: a query at position t sees keys <= t, and with a sliding window only keys
> t - window; scores are soft-capped (cap * tanh(s / cap)) when asked. Attention sinks
(gpt-oss: one logit per query head that joins each row's softmax with no value) are folded
last, as one more state (sink, 1, 0), by whichever kernel ends the fold. Accumulation is in
float32; float32 inputs multiply in IEEE float32 (no TF32), so the result matches the torch
reference backend to float32 rounding.

The launch shapes depend only on (work items, programs per item), and each item finds its
parts from its own length on the device, which is what lets a CUDA graph capture a decode
step: the runner pads the batch to its bucket and fixes the programs per item and the slots
(the parts of the longest context the graph serves); a program left without a part of its
item reads and stores nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Keys per inner step of a program (rows of the K and V tiles).
BLOCK_N = 32
# Query rows (tokens x heads of a group) per program for prefill chunks.
PREFILL_ROWS = 64
# Smallest tile side tl.dot accepts on the GPU.
MIN_DOT = 16
# Keys per part (whole BLOCK_N tiles): the fixed cut every row's fold follows.
PART_KEYS = 128
# Most programs one item's parts are spread over.
MAX_PROGRAMS = 64


@triton.jit
def exp_tanh(x):
    # tanh from exp (no libdevice in the interpreter): saturates to +-1 as exp overflows.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _fold(big_m, big_l, big_a, m, lsum, acc):
    """Fold one part's state (m, lsum, acc) into the running (big_m, big_l, big_a) of the
    same rows; a part whose max is -inf (no visible key) leaves them as they are."""
    top = tl.maximum(big_m, m)
    # Rows that have seen no key yet keep max -inf; shift by 0 so exp gives 0, not nan.
    shift = tl.where(top == float("-inf"), 0.0, top)
    old = tl.exp(big_m - shift)
    new = tl.exp(m - shift)
    big_l = big_l * old + lsum * new
    big_a = big_a * old[:, None] + acc * new[:, None]
    return top, big_l, big_a


# Triton compiles a kernel again for every new combination of its integer arguments' value
# classes (== 1, divisible by 16) and its pointers' alignment (to 16 bytes); these change
# from step to step (the token count, the widest block table; where a step's packed metadata
# puts its fields, and with it whether work_qoff or seq_lens starts on 16 bytes), so they are
# not specialised: one compile per tile shape, not per step. (On an H100 a mixed step whose
# item count was odd compiled a second variant: 1.5 s in the middle of a run.) The metadata
# pointers are read one element at a time, so alignment would gain nothing there.
@triton.jit(do_not_specialize=["window", "num_rows", "max_blocks"],
            do_not_specialize_on_alignment=["tables_ptr", "seq_lens_ptr", "q_start_ptr",
                                            "work_seq_ptr", "work_qoff_ptr", "real_lens_ptr"])
def _attend_part(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, q_start_ptr, work_seq_ptr, work_qoff_ptr,
    real_lens_ptr, sinks_ptr, out_ptr, acc_ptr, m_ptr, l_ptr,
    scale, softcap, window, num_rows, max_blocks,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PART: tl.constexpr, SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr, SINGLE_PART: tl.constexpr, PRECISION: tl.constexpr,
    PADDED: tl.constexpr, SINKS: tl.constexpr,
):
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(work_seq_ptr + w)
    qoff = tl.load(work_qoff_ptr + w)
    t0 = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - t0
    first_pos = tl.load(seq_lens_ptr + seq) - q_len
    # With padding (CUDA graph steps), only the first real_lens[seq] tokens of the chunk are
    # real: the rest are neither computed nor read as keys, so no row ever reads a slot no
    # step wrote (the pool is not zeroed, and 0 x NaN would spoil a whole tile).
    n_real = q_len
    if PADDED:
        n_real = tl.load(real_lens_ptr + seq)

    # Row r of the tile: query token qoff + r // GROUP, head kvh * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    qi = qoff + rows // GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (qi < n_real)
    pos = first_pos + qi
    flat_row = (t0 + qi) * NUM_HEADS + kvh * GROUP + rows % GROUP  # row of [T * H, D]
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + flat_row[:, None] * HEAD_DIM + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Keys any row of the tile can see: [lo, last_pos]; its parts [p_lo, p_hi).
    last_pos = first_pos + tl.minimum(qoff + BLOCK_Q, n_real) - 1
    lo = first_pos * 0
    if WINDOW:
        lo = tl.maximum(lo, first_pos + qoff - window + 1)
    p_lo = lo // PART
    p_hi = last_pos // PART + 1
    stride = 1
    if not SINGLE_PART:  # program j computes parts p_lo + j, p_lo + j + P, ..., each alone
        p_lo += tl.program_id(2)
        stride = tl.num_programs(2)
    # A program with no part (past a short item's parts) reads and stores nothing.
    q_ok = row_ok & (rows * 0 + p_lo < p_hi)
    q = tl.load(q_ptr + flat_row[:, None] * HEAD_DIM + d[None, :],
                mask=q_ok[:, None] & d_ok[None, :], other=0.0)

    cols = tl.arange(0, BLOCK_N)
    big_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    big_l = tl.zeros([BLOCK_M], tl.float32)
    big_a = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    out_mask = row_ok[:, None] & d_ok[None, :]
    for p in range(p_lo, p_hi, stride):
        k_lo = tl.maximum(lo, p * PART)
        k_hi = tl.minimum(last_pos + 1, (p + 1) * PART)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(k_lo // BLOCK_N * BLOCK_N, k_hi, BLOCK_N):
            kpos = start + cols
            k_ok = (kpos >= k_lo) & (kpos < k_hi)
            block = tl.load(tables_ptr + seq * max_blocks + kpos // PAGE, mask=k_ok, other=0)
            kv_row = ((block * PAGE + kpos % PAGE) * NUM_KV_HEADS + kvh) * HEAD_DIM
            kv_mask = k_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
            if SOFTCAP:
                s = softcap * exp_tanh(s / softcap)
            see = k_ok[None, :] & (kpos[None, :] <= pos[:, None])
            if WINDOW:
                see = see & (kpos[None, :] > pos[:, None] - window)
            s = tl.where(see, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen no key yet keeps max -inf; shift by 0 so exp gives 0.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_shift)
            prob = tl.exp(s - m_shift[:, None])
            l_i = l_i * alpha + tl.sum(prob, 1)
            v = tl.load(v_ptr + kv_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(prob.to(q.dtype), v.to(q.dtype),
                                                input_precision=PRECISION)
            m_i = m_new
        if SINGLE_PART:
            big_m, big_l, big_a = _fold(big_m, big_l, big_a, m_i, l_i, acc)
        else:  # part p's state, in its slot; `_merge_parts` folds the slots in order
            part_row = p * num_rows + flat_row
            tl.store(acc_ptr + part_row[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
            tl.store(m_ptr + part_row, m_i, mask=row_ok)
            tl.store(l_ptr + part_row, l_i, mask=row_ok)

    if SINGLE_PART:
        if SINKS:  # the row's head's sink, folded last
            sink = tl.load(sinks_ptr + kvh * GROUP + rows % GROUP, mask=row_ok,
                           other=float("-inf"))
            big_m, big_l, big_a = _fold(big_m, big_l, big_a, sink,
                                        tl.full([BLOCK_M], 1.0, tl.float32),
                                        tl.zeros([BLOCK_M, BLOCK_D], tl.float32))
        # Every valid row sees at least its own position, so big_l > 0.
        out = big_a / tl.where(big_l > 0, big_l, 1.0)[:, None]
        tl.store(out_ptr + flat_row[:, None] * HEAD_DIM + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _load_state(acc_ptr, m_ptr, l_ptr, p, p_end, r, num_rows, d, d_ok, HEAD_DIM: tl.constexpr):
    """Part p's state of row r, or the fold's no-op (-inf, 0, 0) when p >= p_end."""
    one = tl.zeros([1], tl.int32)
    ok = one + p < p_end
    at = p * num_rows + r
    m = tl.load(m_ptr + at + one, mask=ok, other=float("-inf"))
    lsum = tl.load(l_ptr + at + one, mask=ok, other=0.0)
    acc = tl.load(acc_ptr + at * HEAD_DIM + d[None, :], mask=d_ok[None, :] & ok[:, None],
                  other=0.0)
    return m, lsum, acc


@triton.jit(do_not_specialize=["num_rows", "window"],
            do_not_specialize_on_alignment=["positions_ptr"])
def _merge_parts(
    acc_ptr, m_ptr, l_ptr, sinks_ptr, out_ptr, positions_ptr, num_rows, num_parts, window,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PART: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr,
):
    # One program per row of [T * H, D]: fold the parts its position can see, in order
    # (the same fold a single program makes; see the module docstring). Four parts' loads
    # are issued together; a part past the row's last is the fold's exact no-op.
    r = tl.program_id(0)
    pos = tl.load(positions_ptr + r // NUM_HEADS)
    lo = pos * 0
    if WINDOW:
        lo = tl.maximum(lo, pos - window + 1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    big_m = tl.full([1], float("-inf"), tl.float32)
    big_l = tl.zeros([1], tl.float32)
    big_a = tl.zeros([1, BLOCK_D], tl.float32)
    # Padding rows of a graph step may hold any position: stay inside the parts written.
    p_end = tl.minimum(pos // PART + 1, num_parts)
    for p in range(tl.maximum(lo // PART, 0), p_end, 4):
        m0, l0, a0 = _load_state(acc_ptr, m_ptr, l_ptr, p, p_end, r, num_rows, d, d_ok,
                                 HEAD_DIM)
        m1, l1, a1 = _load_state(acc_ptr, m_ptr, l_ptr, p + 1, p_end, r, num_rows, d, d_ok,
                                 HEAD_DIM)
        m2, l2, a2 = _load_state(acc_ptr, m_ptr, l_ptr, p + 2, p_end, r, num_rows, d, d_ok,
                                 HEAD_DIM)
        m3, l3, a3 = _load_state(acc_ptr, m_ptr, l_ptr, p + 3, p_end, r, num_rows, d, d_ok,
                                 HEAD_DIM)
        big_m, big_l, big_a = _fold(big_m, big_l, big_a, m0, l0, a0)
        big_m, big_l, big_a = _fold(big_m, big_l, big_a, m1, l1, a1)
        big_m, big_l, big_a = _fold(big_m, big_l, big_a, m2, l2, a2)
        big_m, big_l, big_a = _fold(big_m, big_l, big_a, m3, l3, a3)
    if SINKS:  # the row's head's sink, folded last (as a single program does)
        sink = tl.load(sinks_ptr + r % NUM_HEADS + tl.zeros([1], tl.int32))
        big_m, big_l, big_a = _fold(big_m, big_l, big_a, sink, tl.full([1], 1.0, tl.float32),
                                    tl.zeros([1, BLOCK_D], tl.float32))
    out = big_a / tl.where(big_l > 0, big_l, 1.0)[:, None]
    tl.store(out_ptr + r * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=d_ok[None, :])


@dataclass(frozen=True)
class AttentionPlan:
    """How one step's queries are tiled: shared by every layer of the step.

    work_seq / work_qoff: [W] int32 on the device, the sequence and first query token of each
    work item; block_q: query tokens per item; num_programs: programs per item (1: one
    program folds all the item's parts; P > 1: program j computes parts j, j + P, ... of
    the item, each into its slot, and `_merge_parts` folds them); num_parts: the slots,
    enough for the longest context the step (or graph) serves; real_lens: [S] int64, where
    chunks are padded (CUDA graph steps), how many of each chunk's tokens are real (0 for a
    padding sequence), else None. None of these changes a bit of the result."""

    work_seq: torch.Tensor
    work_qoff: torch.Tensor
    block_q: int
    num_programs: int
    num_parts: int
    real_lens: torch.Tensor | None = None
    part_keys: int = PART_KEYS


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def block_q_for(max_query_len: int, group: int) -> int:
    """Query tokens per work item: one for decodes, enough to fill PREFILL_ROWS otherwise."""
    if max_query_len <= 1:
        return 1
    return min(_next_pow2(max_query_len), max(1, PREFILL_ROWS // _next_pow2(group)))


def tile_rows(group: int) -> int:
    """Query rows of every tile of a model with `group` query heads per kv head: fixed, so
    that a decode's row and a prefill's row go through the same tensor-core shapes and
    reductions (measured on an H200: 16-row and 64-row tiles round differently)."""
    return max(MIN_DOT, PREFILL_ROWS, _next_pow2(group))


def programs_for(num_items: int, num_kv_heads: int, max_keys: int, target_programs: int,
                 part_keys: int = PART_KEYS) -> int:
    """Programs per item so that about `target_programs` run: 1 when the items alone fill
    the GPU, at most one per part of the longest context and MAX_PROGRAMS."""
    parts = max(1, -(-max_keys // part_keys))
    wanted = -(-target_programs // max(1, num_items * num_kv_heads))
    return max(1, min(parts, wanted, MAX_PROGRAMS))


def launch_for(split: bool | None, num_items: int, num_kv_heads: int, max_keys: int,
               target_programs: int, part_keys: int = PART_KEYS) -> tuple[int, int]:
    """(programs per item, part slots) for contexts of up to `max_keys` keys: `split` None
    chooses by `programs_for`; True forces one program per part, False one per item."""
    parts = max(1, -(-max_keys // part_keys))
    if split is None:
        programs = programs_for(num_items, num_kv_heads, max_keys, target_programs, part_keys)
    else:
        programs = max(2, parts) if split else 1
    return programs, parts


def make_plan(query_lens: list[int], seq_lens: list[int], group: int, num_kv_heads: int,
              device: torch.device, target_programs: int, split: bool | None = None,
              part_keys: int = PART_KEYS) -> AttentionPlan:
    """The tiling of a step from its host-side lengths (`split`: see `launch_for`)."""
    block_q = block_q_for(max(query_lens, default=1), group)
    seqs: list[int] = []
    offs: list[int] = []
    for b, n in enumerate(query_lens):
        for off in range(0, n, block_q):
            seqs.append(b)
            offs.append(off)
    programs, parts = launch_for(split, len(seqs), num_kv_heads, max(seq_lens, default=1),
                                 target_programs, part_keys)
    packed = torch.tensor([seqs, offs], dtype=torch.int32).to(device, non_blocking=True)
    return AttentionPlan(packed[0], packed[1], block_q, programs, parts, part_keys=part_keys)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    positions: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [T, H, D] over a [2, blocks, page, Hkv, D] paged cache -> [T, H, D].

    block_tables [S, max_blocks], seq_lens [S] and query_start [S + 1] (int32 or int64) lay out
    the sequences as in AttentionMetadata, positions [T] each query token's position; their
    K/V for this step are already in the cache. `sinks`: None, or float32 [H] on q's device,
    one logit per query head joining each of its rows' softmax without a value.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, page, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    if plan.part_keys % BLOCK_N:
        raise ValueError(f"part_keys {plan.part_keys} is not a multiple of {BLOCK_N}")
    q = q.contiguous()
    out = torch.empty_like(q)
    block_m = tile_rows(group)
    block_d = max(MIN_DOT, _next_pow2(head_dim))
    num_rows = num_tokens * num_heads
    single = plan.num_programs == 1
    if single:
        acc = m = lsum = out  # unused by the kernel
    else:
        acc = torch.empty((plan.num_parts, num_rows, head_dim), dtype=torch.float32,
                          device=q.device)
        m = torch.empty((plan.num_parts, num_rows), dtype=torch.float32, device=q.device)
        lsum = torch.empty_like(m)
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.dtype != torch.float32
                              or sinks.device != q.device or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be contiguous float32 [{num_heads}] on {q.device}")
    grid = (plan.work_seq.shape[0], num_kv_heads, plan.num_programs)
    _attend_part[grid](
        q, kv_cache[0], kv_cache[1], block_tables, seq_lens, query_start,
        plan.work_seq, plan.work_qoff,
        seq_lens if plan.real_lens is None else plan.real_lens,  # unread unless PADDED
        seq_lens if sinks is None else sinks,  # unread unless SINKS
        out, acc, m, lsum,
        scale, softcap or 1.0, window or 0, num_rows, block_tables.shape[1],
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, GROUP=group,
        BLOCK_Q=plan.block_q, BLOCK_M=block_m, BLOCK_D=block_d, PAGE=page, BLOCK_N=BLOCK_N,
        PART=plan.part_keys, SOFTCAP=bool(softcap), WINDOW=bool(window), SINGLE_PART=single,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PADDED=plan.real_lens is not None, SINKS=sinks is not None,
        # Big tiles (prefill rows x a 256-wide head) over more warps: fewer registers each.
        num_warps=8 if block_m * block_d >= 64 * 128 else 4,
        enable_fp_fusion=False,
    )
    if not single:
        _merge_parts[(num_rows,)](
            acc, m, lsum, seq_lens if sinks is None else sinks, out, positions, num_rows,
            plan.num_parts, window or 0,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, PART=plan.part_keys,
            WINDOW=bool(window), SINKS=sinks is not None, enable_fp_fusion=False,
        )
    return out
