"""The mixture-of-experts feed-forward block, shared by every MoE architecture.

A token's hidden row goes through a router (logits over the experts), keeps its `top_k`
experts, and its output is the weighted sum of those experts' gated MLPs:

    probs   = softmax(router(x))                       float32, over every expert
    chosen  = the top_k experts by probability, ties to the lower expert index
    weights = probs[chosen] (/ their sum when `renormalize`)
    y       = sum over the slots s = 0 .. top_k - 1, in that order, of
              weights[s] * expert[chosen[s]](x)

Qwen3-MoE renormalises when its config says `norm_topk_prob`; Mixtral always (its top-k
then softmax is the same weights); OLMoE never. gpt-oss scores the other way round
(`scoring="topk_softmax"`: the top_k logits, then a softmax over those k alone), adds a bias
to its router and to every expert projection, and gates with its clamped SwiGLU
(`loom.models.layers.ClampedSwiGLU`): parameters of this one block.

Invariants the default mode relies on (DESIGN.md section 5):
- the router is float32 and never quantised, and its logits come from a row-independent
  kernel (`loom_linear_f32` on the CPU kernels at any number of rows), so a token chooses the
  same experts whatever else is in its step;
- each expert is an ordinary gated MLP whose projections are prepared like any other (stacked
  gate/up, then w4a8 from the file's blocks, w8a8 or float): an expert's product for a row
  does not depend on the other rows it is computed with;
- a token's expert outputs are added in slot order, never in the order experts are visited.

A step's tokens are grouped by expert (every expert's rows computed in one call), so each
chosen expert's weights are read once per step however many tokens chose it. On the CPU
kernels the whole block runs in C (`loom.models.moe_kernel`, and inside the fused decoder):
the grouping, routing and slot-order sum are the same there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loom.kernels import linear_f32, use_cpu_kernels
from loom.models.layers import Activation, GatedMLP
from loom.models.moe_kernel import MoEKernel


def expert_count(t: dict[str, Any]) -> int:
    """The number of experts a flat HF text config declares: `num_experts` (Qwen3-MoE's
    checkpoints) or `num_local_experts` (Mixtral's, and what transformers 5 writes for both);
    0 for a dense model."""
    return int(t.get("num_experts") or t.get("num_local_experts") or 0)


class Router(nn.Module):
    """The router's logits: x [T, H] @ weight [E, H].T (+ bias [E]) in float32. Not an
    nn.Linear, so no quantisation method replaces it (llama.cpp keeps `ffn_gate_inp`
    unquantised too)."""

    # The w4a8 blocks hook keeps no file blocks for it: it always computes from values.
    keeps_file_blocks = False

    def __init__(self, hidden_size: int, num_experts: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.num_experts = hidden_size, num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [T, E] in float32."""
        weight, bias = self.weight, self.bias
        if weight.dtype == torch.float32 and use_cpu_kernels(x, weight) and (
                bias is None or bias.dtype == torch.float32):
            return linear_f32(x.float().contiguous(), weight, bias)  # one path for every T
        return torch.nn.functional.linear(x.float(), weight.float(),
                                          None if bias is None else bias.float())


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, experts [T, top_k] int64) of router logits [T, E]: the
    experts in decreasing probability, ties to the lower index (a stable sort, where
    `torch.topk` leaves the order of ties unspecified)."""
    probs = torch.softmax(logits.float(), dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, order)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, order


def route_topk_logits(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) [T, top_k] of router logits [T, E] scored gpt-oss's way: the top_k
    logits in decreasing order (ties to the lower index), then a softmax over those k alone
    (the same weights as `route_topk` renormalised, rounded differently)."""
    logits = logits.float()
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    return torch.softmax(logits.gather(1, order), dim=-1), order


# How a block turns router logits into (weights, experts): `scoring` -> rule.
SCORINGS = ("softmax", "topk_softmax")


class SparseMoE(nn.Module):
    """Router + `num_experts` gated MLPs, `top_k` of them per token (see the module
    docstring). HF-named: `gate.weight`, `experts.<e>.{gate,up,down}_proj.weight`.

    `scoring`: one of SCORINGS ("softmax": `route_topk`, "topk_softmax":
    `route_topk_logits`, which ignores `renormalize`); `router_bias`, `expert_bias`: the
    router and every expert projection have a bias."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int,
                 top_k: int, renormalize: bool, activation: Activation, *,
                 scoring: str = "softmax", router_bias: bool = False,
                 expert_bias: bool = False) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} outside 1..{num_experts} experts")
        if scoring not in SCORINGS:
            raise ValueError(f"scoring {scoring!r} is not one of {SCORINGS}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.activation, self.scoring = activation, scoring
        self.gate = Router(hidden_size, num_experts, bias=router_bias)
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, intermediate_size, activation, bias=expert_bias)
            for _ in range(num_experts))
        # The C form of this block (`loom.models.moe_kernel`), made at first use on the CPU
        # kernels; None where the experts' layers have no kernel form.
        self._kernel: object | None = None
        self._kernel_status = "not built"

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) [T, top_k] of the rows x [T, H]."""
        if self.scoring == "topk_softmax":
            return route_topk_logits(self.gate(x), self.top_k)
        return route_topk(self.gate(x), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        kernel = self._cpu_kernel(x)
        if kernel is not None:
            return kernel(x)
        return self.forward_modules(x)

    def forward_modules(self, x: torch.Tensor) -> torch.Tensor:
        """The block through the expert modules, one call per chosen expert (torch code:
        CUDA, hosts without the kernels, float steps too large for them)."""
        t, k = x.shape[0], self.top_k
        weights, experts = self.route(x)
        flat = experts.reshape(-1)
        # (token, slot) pairs grouped by expert, tokens ascending within an expert.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        slots = torch.empty(t * k, self.hidden_size, dtype=x.dtype, device=x.device)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start:start + count]
            slots[pairs] = self.experts[e](x[pairs // k])
            start += count
        return combine_slots(slots.view(t, k, self.hidden_size), weights.to(x.dtype))

    def _cpu_kernel(self, x: torch.Tensor) -> MoEKernel | None:
        if not use_cpu_kernels(x) or x.dtype != torch.float32:
            return None
        if self._kernel_status == "not built":
            self._kernel, self._kernel_status = MoEKernel.build(self)
        return self._kernel

    def invalidate_kernel(self) -> None:
        """Forget the C form (after the experts' weights changed)."""
        self._kernel, self._kernel_status = None, "not built"

    def __getstate__(self) -> dict[str, Any]:
        """A copy (`copy.deepcopy`, pickle) builds a C form of its own at first use: this
        one's descriptor points into this module's tensors (and ctypes pointers do not
        copy)."""
        state = self.__dict__.copy()
        state["_kernel"], state["_kernel_status"] = None, "not built"
        return state

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, "
                f"renormalize={self.renormalize}, scoring={self.scoring}")


def combine_slots(slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum over s of weights[:, s] * slots[:, s] for slots [T, k, H], weights [T, k], added
    in slot order (the C kernel's order)."""
    out = slots[:, 0] * weights[:, 0:1]
    for s in range(1, slots.shape[1]):
        out = out + slots[:, s] * weights[:, s:s + 1]
    return out
