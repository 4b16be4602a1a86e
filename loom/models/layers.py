"""Building blocks shared by all architectures; variants are chosen by flags."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loom.attention import AttentionSpec, PagedAttention
from loom.errors import UnsupportedModelError
from loom.kernels import elementwise_kernels, linear_f32, rms_norm, use_cpu_kernels
from loom.models.rope import RopeSpec, RotaryEmbedding

# Calls of at least this many rows are compute-bound (prefill chunks, large batches): they
# may multiply in a `large_batch_dtype`.
LARGE_BATCH_ROWS = 32

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class Linear(nn.Linear):
    """nn.Linear whose small float32 CPU batches (decode steps) run on Loom's C kernel.

    Measured on a 2-core AVX2 CPU: the kernel beats torch's matmul below 32 rows, and below
    128 rows for weights larger than the L3 cache (Gemma's 262,144 x 640 output projection:
    30 ms against 53 ms for one row, 50 against 159 ms for eight).
    """

    # Float32 calls of at least LARGE_BATCH_ROWS rows multiply in this dtype, with a copy of
    # the weight kept in it (`set_large_batch_dtype`); None: in the weight's dtype.
    large_batch_dtype: torch.dtype | None = None
    # CUDA calls run Loom's Triton matmul, whose rows do not depend on the batch
    # (`loom.kernels.triton_matmul`), instead of cuBLAS (`set_batch_invariant`).
    batch_invariant: bool = False

    def set_large_batch_dtype(self, dtype: torch.dtype | None) -> None:
        """Multiply large float32 batches in `dtype` (bfloat16 on hosts whose bf16 matmul is
        faster), keeping the weight's copy in it (not saved with the state)."""
        self.large_batch_dtype = dtype
        low = None if dtype is None else self.weight.detach().to(dtype)
        self.register_buffer("weight_large_batch", low, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = x @ weight.T + bias."""
        rows = x.numel() // self.in_features if x.numel() else 0
        big = self.weight.numel() >= 8 * 1024 * 1024
        if (
            0 < rows < (128 if big else 32)
            and self.weight.dtype == torch.float32
            and use_cpu_kernels(x, self.weight)
        ):
            y = linear_f32(x.reshape(rows, self.in_features).contiguous(), self.weight, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        if self.batch_invariant and x.is_cuda and not torch.is_grad_enabled():
            from loom.kernels.triton_matmul import invariant_linear

            return invariant_linear(x, self.weight, self.bias)
        if (self.large_batch_dtype is not None and rows >= LARGE_BATCH_ROWS
                and x.dtype == torch.float32):
            low = self.large_batch_dtype
            y = F.linear(x.to(low), self.weight_large_batch).to(x.dtype)
            return y if self.bias is None else y + self.bias
        return super().forward(x)


def set_batch_invariant(model: nn.Module, on: bool = True) -> int:
    """Run every float `Linear` of `model` on the batch-invariant matmul when on CUDA (the
    CUDA default mode); returns how many layers were set."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.batch_invariant = on
            count += 1
    return count


class RMSNorm(nn.Module):
    """RMS norm computed in float32; `gemma=True` scales by (1 + w) before casting back.

    `forward(x, residual)` returns residual + norm(x) (the fused form decoder layers use).
    Float32 CPU tensors take Loom's C kernel when it is available.
    """

    def __init__(self, dim: int, eps: float, gemma: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Normalise over the last dimension (then add `residual`, if given)."""
        if use_cpu_kernels(x, self.weight) and self.weight.dtype == torch.float32:
            return rms_norm(
                x.contiguous(), self.weight, self.eps, 1.0 if self.gemma else 0.0,
                None if residual is None else residual.contiguous(),
            )
        kernels = elementwise_kernels(x, self.weight)
        if kernels is not None and self._kernel_dtypes_match(x, residual):
            return kernels.rms_norm(x, self.weight, self.eps, self.gemma, residual)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            out = (h * (1.0 + self.weight.float())).to(x.dtype)
        else:
            out = self.weight * h.to(x.dtype)
        return out if residual is None else residual + out

    def _kernel_dtypes_match(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether the result has x's dtype (what the Triton kernel writes): the Gemma form
        casts back to it; the other multiplies by the weight in promoted arithmetic."""
        return (self.gemma or self.weight.dtype == x.dtype) and (
            residual is None or residual.dtype == x.dtype
        )


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's gated activation of (gate, up), elementwise:

        gate = min(gate, limit);  up = clamp(up, -limit, limit)
        out  = (up + 1) * gate * sigmoid(alpha * gate)
    """

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The activation of matching gate and up tensors."""
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


# A gated MLP's activation: the name of act in act(gate) * up (`_ACTIVATIONS`), or a gated
# activation of its own. Only the names have kernels (the fused decoder, the Triton one).
Activation = str | ClampedSwiGLU


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), or down(activation(gate(x), up(x))) for a gated
    activation object; `bias`: every projection has one."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: Activation,
                 bias: bool = False) -> None:
        super().__init__()
        if isinstance(activation, str) and activation not in _ACTIVATIONS:
            raise UnsupportedModelError(
                f"activation {activation!r} not supported; supported: {sorted(_ACTIVATIONS)}"
            )
        self.activation = activation
        self.act = _ACTIVATIONS[activation] if isinstance(activation, str) else None
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

        # Set by `fuse()`: one [2 * intermediate, hidden] projection replacing gate and up.
        self.gate_up_proj: nn.Linear | None = None

    def fuse(self, stack: StackLinears | None = None) -> None:
        """Stack gate and up into one projection (one weight read per step instead of two);
        a no-op once stacked. `stack` builds the stacked layer (default: a float Linear)."""
        if self.gate_up_proj is not None:
            return
        self.gate_up_proj = (stack or _stack_linears)([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gated feed-forward block."""
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            kernels = elementwise_kernels(gate_up) if self.act is not None else None
            if kernels is not None and gate_up.dim() == 2:
                return self.down_proj(kernels.gated_act(gate_up, self.activation))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(self._gated(gate, up))
        return self.down_proj(self._gated(self.gate_proj(x), self.up_proj(x)))

    def _gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.act is None:
            return self.activation(gate, up)
        return self.act(gate) * up


# Builds one layer computing the concatenated outputs of the given linear layers.
StackLinears = Callable[[list[nn.Linear]], nn.Module]


def _stack_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear whose output is the concatenation of the given layers' outputs (on the
    meta device only the shapes: no op runs, so rebuilding a cached model costs nothing)."""
    first = linears[0].weight
    has_bias = any(lin.bias is not None for lin in linears)
    # Built on the meta device (no allocation, no random initialisation: that cost 8 s of a
    # 1.7B model's first load), then given the stacked tensors as its parameters.
    fused = Linear(first.shape[1], sum(lin.weight.shape[0] for lin in linears), bias=has_bias,
                   device="meta", dtype=first.dtype)
    if first.is_meta:
        return fused
    trainable = any(lin.weight.requires_grad for lin in linears)
    weight = torch.cat([lin.weight.detach() for lin in linears])
    fused.weight = nn.Parameter(weight, requires_grad=trainable)
    bias = stacked_bias(linears)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=trainable)
    return fused


def stacked_bias(linears: list[nn.Linear]) -> torch.Tensor | None:
    """The bias of the stack of `linears` (zeros for a part without one), or None when no
    part has one."""
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([
        lin.bias.detach() if lin.bias is not None
        else torch.zeros(lin.weight.shape[0], dtype=lin.weight.dtype, device=lin.weight.device)
        for lin in linears
    ])


class SelfAttention(nn.Module):
    """q/k/v projections (+ optional bias, QK-norm), rotary, paged attention, output proj."""

    def __init__(
        self,
        layer_idx: int,
        hidden_size: int,
        spec: AttentionSpec,
        rope: RopeSpec,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        gemma_norm: bool = False,
        qk_norm_all_heads: bool = False,
        sinks: bool = False,
    ) -> None:
        """`qk_norm_all_heads`: the QK-norm spans each token's whole q (and whole k), every
        head's features at once, before the heads are split (OLMoE); otherwise it is per head
        (Qwen3, Gemma 3). `sinks`: the layer has a learned attention sink per head
        (`self_attn.sinks`, see `AttentionSpec.sinks`)."""
        super().__init__()
        h, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.q_proj = Linear(hidden_size, h * d, bias=qkv_bias)
        self.k_proj = Linear(hidden_size, kv * d, bias=qkv_bias)
        self.v_proj = Linear(hidden_size, kv * d, bias=qkv_bias)
        self.o_proj = Linear(h * d, hidden_size, bias=o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        self.qk_norm_all_heads = qk_norm_all_heads
        if qk_norm_eps is not None:
            q_width, k_width = (h * d, kv * d) if qk_norm_all_heads else (d, d)
            self.q_norm = RMSNorm(q_width, qk_norm_eps, gemma=gemma_norm)
            self.k_norm = RMSNorm(k_width, qk_norm_eps, gemma=gemma_norm)
        self.rotary = RotaryEmbedding(d, rope)
        self.attn = PagedAttention(layer_idx, spec)
        self.sinks = nn.Parameter(torch.empty(h)) if sinks else None
        # Set by `fuse()`: one projection producing [q | k | v].
        self.qkv_proj: nn.Linear | None = None
        self.qkv_sizes = (h * d, kv * d, kv * d)

    def fuse(self, stack: StackLinears | None = None) -> None:
        """Stack q, k and v into one projection (one weight read per step instead of three);
        a no-op once stacked. `stack` builds the stacked layer (default: a float Linear)."""
        if self.qkv_proj is not None:
            return
        self.qkv_proj = (stack or _stack_linears)([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        t = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q_norm, k_norm = self.q_norm, self.k_norm
        if self.qk_norm_all_heads and q_norm is not None and k_norm is not None:
            q, k, q_norm, k_norm = q_norm(q), k_norm(k), None, None
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k, q_norm, k_norm)
        out = self.attn(q.reshape(t, -1), k.reshape(t, -1), v, self.sinks)
        return self.o_proj(out)


def empty_embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """An nn.Embedding whose table is left uninitialised (weights are loaded over it). Its
    default random init, run on the meta device, imports torch._dynamo (2.3 s of start-up)."""
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))


def fuse_projections(model: nn.Module, stack: StackLinears | None = None) -> nn.Module:
    """Stack the q/k/v and gate/up projections of every layer (after weights are loaded);
    `stack` builds each stacked layer (default: a float Linear; the int8 modes pass one that
    quantises the parts and stacks their int8 rows)."""
    for module in list(model.modules()):
        if isinstance(module, SelfAttention | GatedMLP):
            module.fuse(stack)
    return model
