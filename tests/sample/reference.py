"""Straightforward one-row reference implementations of the sampling pipeline (float64 loops)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import torch
from torch import Tensor

from loom.sampling_params import SamplingParams


def ref_penalties(
    logits: Sequence[float],
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
) -> list[float]:
    """Repetition (prompt + output), then frequency and presence (output), token by token."""
    out = list(map(float, logits))
    seen = set(prompt) | set(output)
    counts = Counter(output)
    for tok in range(len(out)):
        if tok in seen:
            r = params.repetition_penalty
            out[tok] = out[tok] / r if out[tok] > 0 else out[tok] * r
        out[tok] -= params.frequency_penalty * counts[tok]
        out[tok] -= params.presence_penalty * (1.0 if counts[tok] else 0.0)
    return out


def ref_min_tokens(
    logits: list[float], params: SamplingParams, output: Sequence[int], eos: set[int]
) -> list[float]:
    """Bans stop ids (and eos unless ignore_eos) while fewer than min_tokens were generated."""
    out = list(logits)
    if len(output) < params.min_tokens:
        banned = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else eos)
        for tok in banned:
            out[tok] = -math.inf
    return out


def _softmax(logits: Sequence[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) if x != -math.inf else 0.0 for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def ref_min_p(logits: list[float], min_p: float) -> list[float]:
    """Drops tokens with probability < min_p * max probability."""
    probs = _softmax(logits)
    cut = min_p * max(probs)
    return [x if p >= cut else -math.inf for x, p in zip(logits, probs, strict=True)]


def ref_top_k(logits: list[float], k: int) -> list[float]:
    """Keeps the k largest logits (and anything tied with the k-th)."""
    if k <= 0 or k >= len(logits):
        return list(logits)
    kth = sorted(logits, reverse=True)[k - 1]
    return [x if x >= kth else -math.inf for x in logits]


def ref_top_p(logits: list[float], p: float) -> tuple[list[float], float]:
    """Keeps the shortest high-probability prefix with mass >= p; also the distance to the edge.

    The distance is min |mass_before_token - p| over tokens, so tests can skip cases where
    float32 and float64 rounding could disagree about membership.
    """
    if p >= 1.0:
        return list(logits), math.inf
    probs = _softmax(logits)
    order = sorted(range(len(logits)), key=lambda i: -probs[i])
    keep: set[int] = set()
    mass = 0.0
    margin = math.inf
    for i in order:
        if probs[i] == 0.0:
            break
        margin = min(margin, abs(mass - p))
        if mass >= p:
            break
        keep.add(i)
        mass += probs[i]
    return [x if i in keep else -math.inf for i, x in enumerate(logits)], margin


def ref_filtered_probs(
    logits_row: Tensor,
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos: set[int] | None = None,
) -> tuple[list[float], float]:
    """The full pipeline for one row, in float64 loops; also the top-p edge distance."""
    logits = ref_penalties(logits_row.double().tolist(), params, prompt, output)
    logits = ref_min_tokens(logits, params, output, eos or set())
    if params.temperature == 0.0:
        best = max(range(len(logits)), key=lambda i: logits[i])
        return [1.0 if i == best else 0.0 for i in range(len(logits))], math.inf
    logits = [x / params.temperature for x in logits]
    logits = ref_min_p(logits, params.min_p)
    logits = ref_top_k(logits, params.top_k)
    logits, margin = ref_top_p(logits, params.top_p)
    return _softmax(logits), margin


def total_variation(p: Sequence[float], q: Sequence[float]) -> float:
    """Half the L1 distance between two distributions."""
    return 0.5 * sum(abs(a - b) for a, b in zip(p, q, strict=True))


def empirical(tokens: Sequence[int], vocab: int) -> list[float]:
    """Frequencies of each token id in `tokens`."""
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab)
    return (counts.double() / len(tokens)).tolist()
