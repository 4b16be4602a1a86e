"""Filters of the random-sampling path: temperature, min-p, top-k and top-p, batched.

Each function takes [R, V] float32 logits and host lists of per-row parameters (one entry
per row) and returns new logits; inputs are never modified. Masked tokens get -inf.
No function reads a tensor back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from loom.kernels import elementwise_kernels

_NEG_INF = float("-inf")


def apply_temperature(logits: Tensor, temperatures: Sequence[float]) -> Tensor:
    """Divides each row by its temperature (all temperatures must be > 0)."""
    if all(t == 1.0 for t in temperatures):
        return logits
    temps = torch.tensor(temperatures, dtype=torch.float32, device=logits.device)
    return logits / temps.unsqueeze(1)


def apply_min_p(logits: Tensor, min_ps: Sequence[float]) -> Tensor:
    """Masks tokens whose probability is below min_p times the row's top probability.

    In logit space, p_i < min_p * p_max  <=>  l_i < l_max + log(min_p), so no softmax is
    needed; min_p = 0 gives log 0 = -inf and masks nothing.
    """
    if all(m == 0.0 for m in min_ps):
        return logits
    log_min_p = torch.tensor(min_ps, dtype=torch.float32, device=logits.device).log()
    threshold = logits.amax(dim=-1, keepdim=True) + log_min_p.unsqueeze(1)
    return logits.masked_fill(logits < threshold, _NEG_INF)


# On CPU a full sort of a 262,144-entry row costs tens of milliseconds, while the top-p
# prefix of a language model's distribution almost always lies within its first few hundred
# tokens: try that many candidates first and sort only the rows they do not cover.
_CANDIDATES = 1024


def _thresholds(values: Tensor, ks: Tensor, ps: Tensor | None, log_norm: Tensor | None) -> Tensor:
    """Per-row keep thresholds from logits sorted descending: [r, w] -> [r].

    A row keeps its top k values (1 <= k <= w), then, renormalised over those, the shortest
    prefix whose probability mass reaches p. Exclusive cumulative mass decides membership:

        position     0    1    2   ...  n-1 | n ...
        excl mass    0   p0  p0+p1 ...  <p  | >= p   -> keep n = #(excl < p) >= 1 tokens

    The threshold is the value at position n-1; everything below it is masked, so ties
    with the threshold are kept (the same rule as top-k alone). With `log_norm` (the row's
    full logsumexp; top-p without top-k) the values may be a prefix of the sorted row.
    """
    keep = ks
    if ps is not None:
        if log_norm is None:
            pos = torch.arange(values.shape[1], device=values.device)
            probs = values.masked_fill(pos >= ks.unsqueeze(1), _NEG_INF).softmax(dim=-1)
        else:
            probs = (values - log_norm.unsqueeze(1)).exp()
        excl = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
        # At least one token: a p so small that float32 rounds it to 0 keeps the top one.
        keep = torch.minimum((excl < ps.unsqueeze(1)).sum(dim=-1), ks).clamp_(min=1)
    return values.gather(1, (keep - 1).unsqueeze(1)).squeeze(1)


def _top_p_thresholds(logits: Tensor, ps: Tensor) -> Tensor:
    """Thresholds [r] for rows with top-p and no top-k, sorting as little as possible."""
    vocab = logits.shape[1]
    log_norm = log_normaliser(logits)
    if logits.device.type != "cpu" or vocab <= 4 * _CANDIDATES:
        ks = torch.full_like(ps, vocab, dtype=torch.long)
        values = logits.sort(dim=-1, descending=True).values
        return _thresholds(values, ks, ps, log_norm)
    values = logits.topk(_CANDIDATES, dim=-1, sorted=True).values
    # The candidates decide a row exactly when their total mass reaches p: every later
    # token then has exclusive mass >= p. Reading the flags back is free on the CPU.
    covered = ((values - log_norm.unsqueeze(1)).exp().sum(dim=-1) >= ps).tolist()
    ks = torch.full_like(ps, _CANDIDATES, dtype=torch.long)
    thresholds = _thresholds(values, ks, ps, log_norm)
    redo = [i for i, ok in enumerate(covered) if not ok]
    if redo:
        index = torch.tensor(redo)
        values = logits.index_select(0, index).sort(dim=-1, descending=True).values
        ks = torch.full((len(redo),), vocab, dtype=torch.long)
        full = _thresholds(values, ks, ps.index_select(0, index), log_norm.index_select(0, index))
        thresholds.index_copy_(0, index, full)
    return thresholds


def apply_top_k_top_p(logits: Tensor, top_ks: Sequence[int], top_ps: Sequence[float]) -> Tensor:
    """Applies top-k, then top-p over the renormalised top-k, to each row.

    top_k <= 0 or >= V and top_p >= 1 disable the filters. Rows with a top-k (with or
    without top-p) share one `torch.topk` of the largest k among them; rows with top-p and
    no top-k need the sorted row (see `_CANDIDATES`). Rows using neither are not touched.
    """
    num_rows, vocab = logits.shape
    ks = [k if 0 < k < vocab else 0 for k in top_ks]
    k_rows = [i for i in range(num_rows) if ks[i]]
    p_rows = [i for i in range(num_rows) if not ks[i] and top_ps[i] < 1.0]
    if not k_rows and not p_rows:
        return logits
    dev = logits.device
    thresholds = torch.full((num_rows,), _NEG_INF, dtype=logits.dtype, device=dev)
    for group in (k_rows, p_rows):
        if not group:
            continue
        index = None if len(group) == num_rows else torch.tensor(group, device=dev)
        sub = logits if index is None else logits.index_select(0, index)
        group_ps = [top_ps[i] for i in group]
        if group is p_rows:
            group_thr = _top_p_thresholds(sub, torch.tensor(group_ps, device=dev))
        else:
            values = sub.topk(max(ks[i] for i in group), dim=-1, sorted=True).values
            ps = None
            if any(p < 1.0 for p in group_ps):
                # p >= 1 keeps the whole row; 2.0 keeps it despite rounding in the cumsum.
                ps = torch.tensor([p if p < 1.0 else 2.0 for p in group_ps], device=dev)
            group_ks = torch.tensor([ks[i] for i in group], device=dev)
            group_thr = _thresholds(values, group_ks, ps, None)
        if index is None:
            thresholds = group_thr
        else:
            thresholds.index_copy_(0, index, group_thr)
    return logits.masked_fill(logits < thresholds.unsqueeze(1), _NEG_INF)


def log_normaliser(logits: Tensor) -> Tensor:
    """log-sum-exp of each row of [R, V] logits, computed per row whatever the batch where a
    row kernel runs (CUDA), torch's logsumexp elsewhere."""
    kernels = elementwise_kernels(logits)
    if kernels is not None and logits.dim() == 2:
        from loom.kernels.triton_logsumexp import logsumexp_rows

        return logsumexp_rows(logits)
    return logits.logsumexp(dim=-1)
