"""Drawing token ids from probability rows by inverse CDF, in two levels, without sorting.

One uniform number per draw instead of V exponentials: the cost is one pass over the row
(block sums) plus a cumulative sum inside a single block. Cumulative sums run in float64,
so tail tokens keep their probability (a float32 cumsum over 262,144 entries would round
the smallest ones away).

    probs   | block 0 (B entries) | block 1 | ... | block nb-1 (zero-padded) |
    level 1: x = (1 - u) * total in (0, total]; block j with cdf[j-1] < x <= cdf[j]
    level 2: r = x - cdf[j-1], rescaled to block j's own cumsum; token with the same rule

The rule "first cdf >= x" with x > 0 never lands on a zero-probability entry.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

_BLOCK = 512
# The smallest positive float32 is ~1.4e-45, so any positive cumulative mass exceeds this.
_TINY = 1e-300


def uniforms(
    generators: Sequence[torch.Generator | None], n: int, device: torch.device
) -> Tensor:
    """[len(generators), n] float64 U[0, 1): row i from generators[i], else the global RNG."""
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        return torch.rand(len(generators), n, dtype=torch.float64, device=device)
    u = torch.empty(len(generators), n, dtype=torch.float64, device=device)
    if unseeded:
        index = torch.tensor(unseeded, device=device)
        shared = torch.rand(len(unseeded), n, dtype=torch.float64, device=device)
        u.index_copy_(0, index, shared)
    for i, generator in enumerate(generators):
        if generator is not None:
            u[i] = torch.rand(n, dtype=torch.float64, device=device, generator=generator)
    return u


def skip_uniforms(generator: torch.Generator, count: int) -> None:
    """Advance `generator` exactly as `uniforms` does for `count` rows that use it."""
    for _ in range(count):
        torch.rand(1, dtype=torch.float64, device=generator.device, generator=generator)


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """Token ids [R, n] drawn from rows of (unnormalised) probs [R, V] with uniforms u [R, n]."""
    num_rows, vocab = probs.shape
    block = min(_BLOCK, vocab)
    pad = (-vocab) % block
    blocks = (F.pad(probs, (0, pad)) if pad else probs).view(num_rows, -1, block)
    mass = blocks.sum(dim=-1).double()  # [R, nb]; float32 sums of `block` entries suffice
    cdf = mass.cumsum(dim=-1)
    x = (1.0 - u) * cdf[:, -1:]
    j = torch.searchsorted(cdf, x).clamp_(max=cdf.shape[1] - 1)  # [R, n]
    r = x - F.pad(cdf, (1, 0)).gather(1, j)
    rows = torch.arange(num_rows, device=probs.device).unsqueeze(1)
    inner = blocks[rows, j].cumsum(dim=-1, dtype=torch.float64)  # [R, n, block]
    inner_total = inner[..., -1]
    r = (r / mass.gather(1, j) * inner_total).clamp_(min=_TINY)
    r = torch.minimum(r, inner_total)
    i = torch.searchsorted(inner, r.unsqueeze(-1)).squeeze(-1)
    return j * block + i
