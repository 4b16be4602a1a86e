"""Checkpoints that store a mixture of experts' projections as 3-D tensors, every expert
stacked in one, cut into Loom's per-expert tensors as they stream in.

Loom keeps each expert an ordinary gated MLP (`loom.models.moe`), so that every quantisation
method prepares it like any other layer; a rule here (data, one per fused tensor) says how
one checkpoint tensor becomes those experts' tensors:

    name  = ....<suffix>                     (model.layers.3.mlp.experts.gate_up_proj)
    piece = <name up to its last dot>.<e>.<parts[j]>        for every expert e and part j

Expert e's slice is tensor[e] ([in, out] when `transposed`: stored for x @ W, as gpt-oss
does; turned to Loom's [out, in]); its output rows are dealt to the parts in turn, row r to
part r % len(parts) (gpt-oss interleaves gate and up: gate = rows 0, 2, 4, ..., up = rows
1, 3, 5, ...). A bias is the same with one dimension less. Every piece is a fresh contiguous
tensor, so it becomes its parameter without another copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from loom.errors import InvalidModelError


@dataclass(frozen=True)
class FusedExpertTensor:
    """One fused checkpoint tensor: its name's ending (whole dot-separated names, the last
    being the tensor's own), the per-expert parameter names its rows are dealt to, and
    whether each expert's matrix is stored transposed ([in, out])."""

    suffix: str
    parts: tuple[str, ...]
    transposed: bool = False


def split_expert_tensors(weights: Iterable[tuple[str, torch.Tensor]],
                         rules: tuple[FusedExpertTensor, ...],
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` with every tensor a rule names replaced by its per-expert pieces (in expert
    order, then part order); the others pass through unchanged."""
    for name, tensor in weights:
        rule = next((r for r in rules if name.endswith("." + r.suffix)), None)
        if rule is None:
            yield name, tensor
            continue
        yield from _pieces(name.rpartition(".")[0], name, tensor, rule)


def _pieces(module: str, name: str, tensor: torch.Tensor, rule: FusedExpertTensor,
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """The per-expert pieces of one fused tensor (see the module docstring)."""
    n = len(rule.parts)
    want_dims = 3 if rule.transposed else 2
    if tensor.dim() != want_dims or tensor.shape[-1] % n:
        raise InvalidModelError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}; expected {want_dims} dimensions"
            f" [experts, ...] whose output size divides into {n} parts")
    for e in range(tensor.shape[0]):
        expert = tensor[e].T if rule.transposed else tensor[e]
        for j, part in enumerate(rule.parts):
            yield f"{module}.{e}.{part}", expert[j::n].clone(memory_format=torch.contiguous_format)
