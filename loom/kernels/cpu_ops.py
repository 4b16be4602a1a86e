"""Tensor-level wrappers of the C kernels: validate, allocate outputs, pass pointers."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from loom.kernels.build import load_library
from loom.kernels.pack_workers import packed_tensor
from loom.kernels.w8a8_layout import PACKED_COLUMNS, to_packed_layout


def cpu_kernels_available() -> bool:
    """True when the compiled CPU kernels loaded on this machine."""
    return load_library() is not None


def use_cpu_kernels(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """Whether an op on float32 CPU tensor `x` (and `params`) should run on these kernels:
    they loaded, and autograd has nothing to record (the kernels have no backward)."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and cpu_kernels_available()
        and not (
            torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
        )
    )


# Element types of a KV cache the attention kernels read (and the fused decoder writes).
KV_CACHE_KERNEL_DTYPES = (torch.float32, torch.float16)


def _lib() -> ctypes.CDLL:
    lib = load_library()
    if lib is None:
        raise RuntimeError("Loom CPU kernels are unavailable (see loom.kernels.kernel_status())")
    return lib


def _check(t: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(
            f"{name}: need a contiguous {dtype} CPU tensor, got {t.dtype} on {t.device}"
            f"{'' if t.is_contiguous() else ' (not contiguous)'}"
        )


def linear_w8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    quantize_activations: bool = False,
    layout: str = "rows",
) -> torch.Tensor:
    """x [M, K] float32 @ (weight [N, K] int8 * scale [N] float32).T + bias [N] -> [M, N].

    `quantize_activations=True` (w8a8) rounds each block of 32 activations to int8 (own scale)
    and multiplies in integers, by one arithmetic for any M; needs K % 32 == 0. Its weight is
    `layout="packed"` (uint8, as `loom.kernels.w8a8_layout.to_packed_layout` stores it) or row-major
    int8 (`"rows"`: packed here on every call, for tests); both give the same bits.
    """
    _check(x, "x", torch.float32)
    _check(scale, "scale", torch.float32)
    m, k = x.shape
    n = scale.shape[0]
    if layout not in ("rows", "packed"):
        raise ValueError(f"unknown weight layout {layout!r}")
    if layout == "packed" and not quantize_activations:
        raise ValueError("the packed layout is read by the w8a8 kernel only")
    if quantize_activations and k % 32:
        raise ValueError(f"quantize_activations needs K % 32 == 0, got K = {k}")
    if layout == "packed":
        _check(weight, "weight", torch.uint8)
        shape_ok = weight.shape == (-(-n // PACKED_COLUMNS), k // 4, PACKED_COLUMNS, 4)
    else:
        _check(weight, "weight", torch.int8)
        shape_ok = weight.shape == (n, k)
    if not shape_ok or scale.dim() != 1:
        raise ValueError(f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)} ({layout}), "
                         f"scale {tuple(scale.shape)} do not match")
    if bias is not None:
        _check(bias, "bias", torch.float32)
    if quantize_activations and layout == "rows":
        weight = to_packed_layout(weight)
    y = torch.empty((m, n), dtype=torch.float32)
    lib = _lib()
    fn = lib.loom_linear_w8a8_packed if quantize_activations else lib.loom_linear_w8
    fn(
        x.data_ptr(), m, k, weight.data_ptr(), scale.data_ptr(),
        None if bias is None else bias.data_ptr(), n, y.data_ptr(),
    )
    return y


def linear_w8a8_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """The w8a8 arithmetic computed one output at a time in plain C (row-major int8 weight):
    what `linear_w8(..., quantize_activations=True)` must equal bit for bit."""
    _check(x, "x", torch.float32)
    _check(weight, "weight", torch.int8)
    _check(scale, "scale", torch.float32)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape != (n, k) or k % 32 or scale.shape != (n,):
        raise ValueError(f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"scale {tuple(scale.shape)} do not match (K % 32 == 0)")
    if bias is not None:
        _check(bias, "bias", torch.float32)
    y = torch.empty((m, n), dtype=torch.float32)
    _lib().loom_linear_w8a8_ref(
        x.data_ptr(), m, k, weight.data_ptr(), scale.data_ptr(),
        None if bias is None else bias.data_ptr(), n, y.data_ptr(),
    )
    return y


def linear_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T + bias [N], all float32, for small M (decode batches)."""
    _check(x, "x", torch.float32)
    _check(weight, "weight", torch.float32)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)} do not match")
    if bias is not None:
        _check(bias, "bias", torch.float32)
    y = torch.empty((m, n), dtype=torch.float32)
    _lib().loom_linear_f32(
        x.data_ptr(), m, k, weight.data_ptr(), None if bias is None else bias.data_ptr(), n,
        y.data_ptr(),
    )
    return y


def paged_attention(
    q: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context.

    q [T, H, D]; sequence i owns query rows [query_start_loc[i], query_start_loc[i + 1]), the
    last positions of its seq_lens[i]; their K/V are already in kv_cache [2, blocks,
    block_size, Hkv, D] float32 or float16. block_tables [S, max_blocks] int64;
    `max_seq_len` >= every seq_len. `sinks`: None, or float32 [H], one logit per query
    head that joins each of its rows' softmax (the max and the sum) without a value (gpt-oss's
    attention sinks; not multiplied by `scale`). Returns [T, H, D].
    """
    _check(q, "q", torch.float32)
    _check(query_start_loc, "query_start_loc", torch.int64)
    if kv_cache.dtype not in KV_CACHE_KERNEL_DTYPES:
        raise ValueError(f"kv_cache: {kv_cache.dtype} is not one of {KV_CACHE_KERNEL_DTYPES}")
    _check(kv_cache, "kv_cache", kv_cache.dtype)
    _check(block_tables, "block_tables", torch.int64)
    _check(seq_lens, "seq_lens", torch.int64)
    _, h, d = q.shape
    _, _, block_size, hkv, d_cache = kv_cache.shape
    s = seq_lens.shape[0]
    if (d_cache != d or h % hkv or block_tables.shape[0] != s
            or query_start_loc.shape != (s + 1,)):
        raise ValueError("q, query_start_loc, kv_cache, block_tables and seq_lens do not match")
    if sinks is not None:
        _check(sinks, "sinks", torch.float32)
        if sinks.shape != (h,):
            raise ValueError(f"sinks {tuple(sinks.shape)} must be one logit per head ({h},)")
    lib = _lib()
    out = torch.empty_like(q)
    lib.loom_paged_attention(
        q.data_ptr(), query_start_loc.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
        block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), s, h, hkv, d,
        block_size, window or 0, scale, softcap or 0.0,
        None if sinks is None else sinks.data_ptr(), max_seq_len,
        out.data_ptr(), int(kv_cache.dtype == torch.float16),
    )
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """[residual +] x / rms(x) * (weight + offset) over the last dim of x [..., D], float32."""
    _check(x, "x", torch.float32)
    _check(weight, "weight", torch.float32)
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    if residual is not None:
        _check(residual, "residual", torch.float32)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    out = torch.empty_like(x)
    _lib().loom_rms_norm(
        x.data_ptr(), x.numel() // dim, dim, weight.data_ptr(), offset, eps,
        None if residual is None else residual.data_ptr(), out.data_ptr(),
    )
    return out


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x [T, H, D] with float32 tables cos/sin [T, D]."""
    _check(x, "x", torch.float32)
    _check(cos, "cos", torch.float32)
    _check(sin, "sin", torch.float32)
    tokens, heads, d = x.shape
    if cos.shape != (tokens, d) or sin.shape != (tokens, d):
        raise ValueError(f"tables {tuple(cos.shape)} do not match x {tuple(x.shape)}")
    out = torch.empty_like(x)
    _lib().loom_rope_neox(
        x.data_ptr(), tokens, heads, d, cos.data_ptr(), sin.data_ptr(), out.data_ptr()
    )
    return out


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> None:
    """In place: logits[rows[i], j] = -inf where bit j of bits[i] is clear. float32 logits
    [N, V] (contiguous), int64 rows [n], int32 bits [n, ceil(V / 32)]."""
    _check(logits, "logits", torch.float32)
    _check(rows, "rows", torch.int64)
    _check(bits, "bits", torch.int32)
    _lib().loom_apply_token_bitmask(logits.data_ptr(), logits.shape[1], rows.data_ptr(),
                                    rows.numel(), bits.data_ptr(), bits.shape[1])


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of float32 logits [B, V]: (first argmax [B] int64, logsumexp [B] float32)."""
    _check(logits, "logits", torch.float32)
    rows, vocab = logits.shape
    idx = torch.empty(rows, dtype=torch.int64)
    lse = torch.empty(rows, dtype=torch.float32)
    _lib().loom_argmax_logsumexp(logits.data_ptr(), rows, vocab, idx.data_ptr(), lse.data_ptr())
    return idx, lse


# GGML block types `dequantize_gguf_blocks` decodes in C: type id -> (bytes, values) a block.
GGUF_C_BLOCK_TYPES: dict[int, tuple[int, int]] = {
    2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32), 8: (34, 32), 12: (144, 256),
    13: (176, 256), 14: (210, 256), 39: (17, 32),
}


def dequantize_gguf_blocks(raw: np.ndarray, type_id: int, out: torch.Tensor) -> bool:
    """Decode `raw` (the blocks of a GGUF tensor, uint8, C-contiguous) into `out` (float32,
    contiguous, one value per element) in C, with the `gguf` package's arithmetic bit for bit;
    False (nothing written) where the kernels are not loaded or do not know the type."""
    lib = load_library()
    shape = GGUF_C_BLOCK_TYPES.get(type_id)
    if lib is None or shape is None:
        return False
    block_bytes, block_values = shape
    if raw.dtype != np.uint8 or not raw.flags.c_contiguous or raw.size % block_bytes:
        raise ValueError(f"GGUF block data of type {type_id} must be whole contiguous blocks")
    blocks = raw.size // block_bytes
    _check(out, "out", torch.float32)
    if out.numel() != blocks * block_values:
        raise ValueError(f"{blocks} blocks hold {blocks * block_values} values, "
                         f"not the {out.numel()} of the output")
    return lib.loom_dequantize(type_id, raw.ctypes.data, blocks, out.data_ptr()) == 0


# GGUF block types the w4a8 kernel computes from (see "w4a8" in cpu/w4a8_kquants.c): type id ->
# (packed bytes per group of 8 columns and record, k a record covers). The K-quants of Q4_K_M
# and Q5_K_M files (Q4_K, Q5_K, Q6_K) in records of a super-block of 256; the blocks of 32
# (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: whole files of those types, and the K-quants' fallback where
# a matrix's rows are not whole super-blocks) in records of one block.
W4A8_TYPES: dict[int, tuple[int, int]] = {
    12: (1184, 256), 13: (2208, 256), 14: (1680, 256),
    2: (144, 32), 3: (160, 32), 6: (272, 32), 7: (288, 32), 8: (272, 32), 39: (144, 32),
}
W4A8_GROUP = 8
W4A8_MAX_SEGMENTS = 4  # W4_MAX_SEGMENTS in cpu/w4a8_kquants.c


def w4a8_record_k(type_id: int) -> int:
    """The k one packed record of `type_id` covers (its input widths are multiples of it)."""
    return W4A8_TYPES[type_id][1]


def w4a8_packed_shape(type_id: int, n: int, k: int) -> tuple[int, int, int]:
    """The packed layout's shape for a [n, k] tensor of `type_id`: (groups of 8 columns,
    records along k, record bytes)."""
    record_bytes, record_k = W4A8_TYPES[type_id]
    return -(-n // W4A8_GROUP), k // record_k, record_bytes


def w4a8_pack(raw: torch.Tensor, type_id: int, n: int, k: int) -> torch.Tensor:
    """The file's blocks of a [n, k] tensor of a W4A8_TYPES type (uint8, contiguous)
    repacked as the w4a8 kernel reads them: uint8 [ceil(n / 8), records, record bytes], in
    huge pages; inside `loom.kernels.pack_workers.packing_in_background` written on a
    worker thread by the end of that block (a first load packs thousands of them)."""
    if type_id not in W4A8_TYPES or k % w4a8_record_k(type_id):
        raise ValueError(f"w4a8 packs GGUF types {sorted(W4A8_TYPES)} with k a multiple of "
                         f"their block (32, or 256 for K-quants), got type {type_id}, k = {k}")
    _check(raw, "raw", torch.uint8)
    block_bytes, block_values = GGUF_C_BLOCK_TYPES[type_id]
    if raw.numel() != n * k // block_values * block_bytes:
        raise ValueError(f"{raw.numel()} bytes are not a [{n}, {k}] tensor of type {type_id}")
    lib = _lib()

    def fill(out: torch.Tensor) -> None:  # every byte of `out` is written
        if lib.loom_w4a8_pack(type_id, raw.data_ptr(), n, k, out.data_ptr()) != 0:
            raise ValueError(f"w4a8 cannot pack type {type_id}")

    return packed_tensor(w4a8_packed_shape(type_id, n, k), fill, raw.numel())


def w4a8_dequantize(packed: torch.Tensor, type_id: int, n: int, k: int) -> torch.Tensor:
    """The float32 weight [n, k] of a packed tensor: the file's dequantised values, bit for
    bit."""
    _check(packed, "packed", torch.uint8)
    out = torch.empty((n, k), dtype=torch.float32)
    if _lib().loom_w4a8_dequantize(type_id, packed.data_ptr(), n, k, out.data_ptr()) != 0:
        raise ValueError(f"w4a8 cannot dequantize type {type_id}")
    return out


def w4a8_rows(packed: torch.Tensor, type_id: int, n: int, k: int,
              ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64, any shape) of a packed [n, k] tensor as float32 [*ids.shape, k]:
    the file's values bit for bit (an embedding lookup)."""
    _check(packed, "packed", torch.uint8)
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty((flat.numel(), k), dtype=torch.float32)
    if _lib().loom_w4a8_rows(type_id, packed.data_ptr(), n, k, flat.data_ptr(), flat.numel(),
                             out.data_ptr()) != 0:
        raise ValueError(f"token ids must lie in [0, {n}) (type {type_id})")
    return out.view(*ids.shape, k)


def linear_w4a8(x: torch.Tensor, segments: list[tuple[int, torch.Tensor, int]],
                bias: torch.Tensor | None, reference: bool = False) -> torch.Tensor:
    """x [M, K] float32 times the packed weights `segments` [(type id, packed, columns), ...]
    stacked along the outputs (+ bias) -> [M, sum of columns], in the w4a8 arithmetic (int8
    activations per block of 32, exact integer block sums, one fixed float order: the same
    bits for a row in any call). `reference=True` runs the plain-C oracle."""
    _check(x, "x", torch.float32)
    m, k = x.shape
    n = sum(cols for _, _, cols in segments)
    if not 1 <= len(segments) <= W4A8_MAX_SEGMENTS:
        raise ValueError(f"w4a8 takes 1 to {W4A8_MAX_SEGMENTS} segments, got {len(segments)}")
    for type_id, packed, cols in segments:
        _check(packed, "packed", torch.uint8)
        want = (w4a8_packed_shape(type_id, cols, k)
                if type_id in W4A8_TYPES and k % w4a8_record_k(type_id) == 0 else None)
        if tuple(packed.shape) != want:
            raise ValueError(f"packed weight {tuple(packed.shape)} is not type {type_id} "
                             f"[{cols}, {k}] (want {want})")
    if bias is not None:
        _check(bias, "bias", torch.float32)
        if bias.numel() != n:
            raise ValueError(f"bias has {bias.numel()} values for {n} outputs")
    count = len(segments)
    types = (ctypes.c_int64 * count)(*[t for t, _, _ in segments])
    pointers = (ctypes.c_void_p * count)(*[p.data_ptr() for _, p, _ in segments])
    columns = (ctypes.c_int64 * count)(*[c for _, _, c in segments])
    y = torch.empty((m, n), dtype=torch.float32)
    lib = _lib()
    fn = lib.loom_linear_w4a8_ref if reference else lib.loom_linear_w4a8
    fn(x.data_ptr(), m, k, count, types, pointers, columns,
       None if bias is None else bias.data_ptr(), y.data_ptr())
    return y


# The gated activations of the C kernels (`gated_act_row` in cpu/decoder_layer.c): name ->
# the code the fused decoder's layers and the MoE block carry. Code CLAMPED_SWIGLU_CODE is
# gpt-oss's clamped SwiGLU, which also carries its alpha and limit.
GATED_ACTIVATION_CODES: dict[str, int] = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}
CLAMPED_SWIGLU_CODE = 2


def gated_act(gate_up: torch.Tensor, activation: str | tuple[float, float]) -> torch.Tensor:
    """act(gate, up) of each row gate_up [M, 2 * I] = gate | up -> [M, I] float32: the code
    the fused decoder's feed-forward blocks and the MoE block run (the tests' oracle).
    `activation`: a name of GATED_ACTIVATION_CODES (act(gate) * up), or (alpha, limit) of
    the clamped SwiGLU."""
    _check(gate_up, "gate_up", torch.float32)
    if isinstance(activation, tuple):
        code, (alpha, limit) = CLAMPED_SWIGLU_CODE, activation
    elif activation in GATED_ACTIVATION_CODES:
        code, alpha, limit = GATED_ACTIVATION_CODES[activation], 0.0, 0.0
    else:
        raise ValueError(f"activation {activation!r} is not one of "
                         f"{sorted(GATED_ACTIVATION_CODES)} or (alpha, limit)")
    m, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up has an odd width {width}")
    out = torch.empty((m, width // 2), dtype=torch.float32)
    _lib().loom_gated_act(gate_up.data_ptr(), m, width // 2, code, alpha, limit,
                          out.data_ptr())
    return out


# How the C MoE block scores router logits (`scoring` of loom.models.moe.SparseMoE -> the
# code of cpu/moe.c's moe_route_row).
MOE_SCORING_CODES: dict[str, int] = {"softmax": 0, "topk_softmax": 1}


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax",
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, experts [T, top_k] int64) of router logits [T, E]
    float32, as the C MoE block routes. "softmax": softmax in float32, the top_k experts by
    probability (ties to the lower index), their probabilities as weights, divided by their
    sum (added in slot order) when `renormalize`; "topk_softmax": the top_k experts by logit
    (ties to the lower index), weights the softmax of those k logits."""
    _check(logits, "logits", torch.float32)
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got {tuple(logits.shape)}")
    t, e = logits.shape
    if not 0 < top_k <= e:
        raise ValueError(f"top_k {top_k} outside 1..{e} experts")
    if scoring not in MOE_SCORING_CODES:
        raise ValueError(f"scoring {scoring!r} is not one of {sorted(MOE_SCORING_CODES)}")
    weights = torch.empty((t, top_k), dtype=torch.float32)
    experts = torch.empty((t, top_k), dtype=torch.int64)
    if t:
        _lib().loom_moe_route(logits.data_ptr(), t, e, top_k, int(renormalize),
                              MOE_SCORING_CODES[scoring], weights.data_ptr(),
                              experts.data_ptr())
    return weights, experts
