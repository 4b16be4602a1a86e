"""int8 linear layers ("int8": weight-only; "w8a8": int8 activations too), swapped into a model.

Weights are per-output-channel symmetric int8 (w[n, k] ~ w_int8[n, k] * scale[n]). Float32
activations on a CPU with Loom's compiled kernels (`loom.kernels`) run through C kernels:
"w8a8" rounds the activations to int8 per block of 32 and multiplies in integers (vpdpbusd
on VNNI CPUs), with the weight packed for that kernel; it serves every call, one decode row
or a prefill chunk of thousands, by one arithmetic (see `w8a8_body` in kernels/cpu/w8a8.c), so a
row's result is the same bits in any batch. "int8" keeps the activations in float32 and uses
its kernel for small calls. Elsewhere small batches use `aten._weight_int8pack_mm` on
bfloat16 activations, and large ones dequantise and use the float matmul ("w8a8" after
rounding the activations as the kernel does), which agrees with the kernel to float
rounding only. The embedding lookup stays exact: a tied output projection gets its own int8
copy while the embedding table keeps the model dtype.

Measured and rejected on an AVX2 CPU (Gemma 3 270M, teacher-forced top-1 vs float32):
fbgemm's `quantized::linear_dynamic` is about 2x faster but quantises activations per call
to uint8, which drops top-1 agreement to 56% (weight-only: 94%).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from loom.kernels import cpu_kernels_available, linear_w8, use_cpu_kernels
from loom.kernels.w8a8_layout import PACKED_COLUMNS, from_packed_layout, to_packed_layout
from loom.models.layers import Linear, stacked_bias

# Elements per slice of rows `quantize_weight_int8` converts at a time: its float32
# temporaries stay near 4 MB each, however large the matrix (a 128k-row output projection
# would otherwise need several float32 copies of itself while loading).
_QUANTIZE_SLICE = 1 << 20


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: returns (w_int8 [N, K], bfloat16 scales [N]). Rows are
    independent, so converting them a slice at a time gives the same bits."""
    rows, cols = weight.shape
    w_int8 = torch.empty((rows, cols), dtype=torch.int8, device=weight.device)
    scales = torch.empty(rows, dtype=torch.float32, device=weight.device)
    step = max(1, _QUANTIZE_SLICE // max(1, cols))
    for start in range(0, rows, step):
        w = weight.detach()[start:start + step].float()
        # Scales are rounded to bfloat16 (the kernel's dtype) before the weights are divided.
        part = (w.abs().amax(dim=1) / 127.0).clamp_(min=1e-30).to(torch.bfloat16).float()
        w_int8[start:start + step] = torch.round(w / part[:, None]).clamp_(-127, 127)
        scales[start:start + step] = part
    return w_int8, scales.to(torch.bfloat16)


# Calls with at least this many rows take the dequantised float path (see `forward`)...
DEQUANTIZE_MIN_ROWS = 32
# ... except that calls with fewer rows than this use loom.kernels when they can: measured on
# a 2-core AVX2 CPU, the kernel beats dequantise-and-matmul up to about 128-256 rows.
KERNEL_MAX_ROWS = 128


def round_activations_q8(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 (K % 32 == 0) with each block of 32 rounded to int8 on its own scale,
    as the w8a8 kernel rounds it (scale = max|x| / 127, q = round-half-even(x / scale)),
    returned dequantised (q * scale) in float32."""
    rows, k = x.shape
    blocks = x.view(rows, k // 32, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return (torch.round(blocks * inverse) * scale).view(rows, k)


class Int8Linear(nn.Module):
    """y = x @ (w_int8 * scale).T + bias, reading int8 weights at run time.

    `weight_q` holds the int8 weight row-major, or, in w8a8 mode on a machine with the CPU
    kernels, packed as their w8a8 kernel reads it (`layout == "packed"`, `to_packed_layout`):
    then every call, a decode row or a prefill chunk of any size, runs that kernel, so a row's
    result is the same bits whatever else is in the call.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, quantize_activations: bool = False,
        int8: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """From a float `weight`, or from its per-row quantisation `int8` = (w_int8, scales)
        already made (then `weight` may be a meta tensor giving only the shape)."""
        super().__init__()
        # w8a8: the CPU kernel also rounds activations to int8 per block of 32.
        self.quantize_activations = quantize_activations and weight.shape[1] % 32 == 0
        self.out_features, self.in_features = n, k = weight.shape
        packed = self.quantize_activations and cpu_kernels_available()
        self.layout = "packed" if packed else "rows"
        if weight.is_meta and int8 is None:  # a cached model's structure: shapes only
            meta = {"device": "meta"}
            groups = -(-n // PACKED_COLUMNS)
            w_q = (torch.empty((groups, k // 4, PACKED_COLUMNS, 4), dtype=torch.uint8, **meta)
                   if packed else torch.empty((n, k), dtype=torch.int8, **meta))
            scales = torch.empty(n, dtype=torch.bfloat16, **meta)
            scales_f32 = torch.empty(n, dtype=torch.float32, **meta)
            bias_f32 = None if bias is None else torch.empty(n, dtype=torch.float32, **meta)
        else:
            w_int8, scales = int8 if int8 is not None else quantize_weight_int8(weight)
            w_q = to_packed_layout(w_int8) if packed else w_int8
            scales_f32 = scales.float()
            bias_f32 = None if bias is None else bias.detach().float().clone()
        # What calls of at least DEQUANTIZE_MIN_ROWS rows multiply in (float32 inputs only):
        # bfloat16 when explicitly asked for (`prefill_dtype`, `set_large_batch_dtype`).
        self.large_batch_dtype = torch.float32
        self.register_buffer("weight_q", w_q)
        self.register_buffer("scales", scales)  # bfloat16, the kernel's activation dtype
        self.register_buffer("scales_f32", scales_f32)  # the same values, for loom.kernels
        self.register_buffer("bias", bias_f32)

    @classmethod
    def stacked(cls, linears: list[nn.Linear], quantize_activations: bool) -> Int8Linear:
        """One Int8Linear whose output is the concatenation of `linears`' outputs. Each part is
        quantised on its own and the int8 rows are stacked: rows are quantised independently,
        so this is the stacked float weight's quantisation bit for bit, without making that
        float copy (a float32 gate/up stack is twice the layer's largest matrix)."""
        weights = [lin.weight for lin in linears]
        rows, cols = sum(w.shape[0] for w in weights), weights[0].shape[1]
        bias = stacked_bias(linears)
        shape_only = torch.empty((rows, cols), dtype=weights[0].dtype, device="meta")
        if weights[0].is_meta:
            return cls(shape_only, bias, quantize_activations)
        parts = [quantize_weight_int8(w) for w in weights]
        int8 = (torch.cat([q for q, _ in parts]), torch.cat([sc for _, sc in parts]))
        return cls(shape_only, bias, quantize_activations, int8=int8)

    def row_major_int8(self) -> torch.Tensor:
        """The int8 weight [N, K], row-major (a copy when stored packed)."""
        if self.layout == "packed":
            return from_packed_layout(self.weight_q, self.out_features)
        return self.weight_q

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight this layer computes with (for tests and inspection)."""
        return self.row_major_int8().float() * self.scales.float()[:, None]

    def _kernel_applies(self, x: torch.Tensor, rows: int) -> bool:
        """w8a8 (packed) runs every call on the kernel, so a row's bits never depend on the
        call's size, unless large calls were explicitly asked to multiply in another dtype;
        weight-only int8 uses it below KERNEL_MAX_ROWS rows."""
        if not use_cpu_kernels(x):
            return False
        if self.layout == "packed":
            return rows < DEQUANTIZE_MIN_ROWS or self.large_batch_dtype == torch.float32
        return rows < KERNEL_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer to x [..., K] -> [..., N] in x's dtype."""
        lead = x.shape[:-1]
        rows = x.numel() // self.in_features
        if self._kernel_applies(x, rows):
            x32 = x.reshape(rows, self.in_features).contiguous()
            bias = None if self.bias is None else self.bias.float()
            y = linear_w8(
                x32, self.weight_q, self.scales_f32.float(), bias, self.quantize_activations,
                self.layout,
            )
            return y.view(*lead, self.out_features)
        if rows >= DEQUANTIZE_MIN_ROWS:
            # Prefill-sized calls are compute-bound, where the int8 kernel is slow: dequantise
            # once (N*K work, small next to M*N*K) and use the float matmul. In w8a8 mode the
            # activations are rounded to int8 exactly as the kernel rounds them, so a token's
            # logits agree across the two paths to float rounding (a session's small appends
            # and a fresh prefill of the same tokens see the same model).
            xf = x.reshape(rows, self.in_features)
            if self.quantize_activations:
                xf = round_activations_q8(xf.float())
            compute = self.large_batch_dtype if x.dtype == torch.float32 else x.dtype
            weight = self.dequantized_weight().to(compute)
            y = torch.nn.functional.linear(xf.to(compute), weight).to(x.dtype)
        else:
            scales = self.scales.to(torch.bfloat16)  # no-op unless the module was cast
            w_int8 = self.row_major_int8()
            x2 = x.reshape(rows, self.in_features).to(torch.bfloat16)
            y = torch.ops.aten._weight_int8pack_mm(x2, w_int8, scales).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*lead, self.out_features)


def set_large_batch_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Make the linear layers of `model`'s decoder layers (all of `model` when it has none)
    multiply float32 calls of many rows in `dtype`. The output projection keeps its dtype:
    it sees only the rows that need logits, and a bf16 copy of a large vocabulary's weight
    would cost hundreds of MB."""
    layers = model.model.layers if isinstance(getattr(model, "model", None), nn.Module) else model
    for module in layers.modules():
        if isinstance(module, Int8Linear):
            module.large_batch_dtype = dtype
        elif isinstance(module, Linear) and module.weight.dtype == torch.float32:
            module.set_large_batch_dtype(dtype)
    invalidate = getattr(model, "invalidate_fused_decoder", None)
    if invalidate is not None:  # which steps the fused decoder may take depends on it
        invalidate()


def quantize_model_int8(
    model: nn.Module, quantize_activations: bool = False,
    first: Callable[[nn.Linear], nn.Module | None] | None = None,
) -> nn.Module:
    """Replace every nn.Linear of `model` (the output projection included) by Int8Linear,
    or by what `first(linear)` makes where it makes one (w4a8: the file's own blocks).

    `quantize_activations=True` is the "w8a8" mode: activations are rounded to int8 per block
    of 32 (by the CPU kernel for small batches, in torch before the float matmul for large
    ones).
    """
    targets = [
        (name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        made = first(linear) if first is not None else None
        setattr(parent, child, made if made is not None
                else Int8Linear(linear.weight, linear.bias, quantize_activations))
    return model
