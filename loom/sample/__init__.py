"""Batched, vectorised sampling: penalties, filters, seeded per-request generators."""

from loom.sample.rows import SAMPLING_EPS, SamplingRow, is_greedy, make_generator
from loom.sample.sampler import Sampler, SamplerOutput, filtered_probs, sample_from_logits

__all__ = [
    "SAMPLING_EPS",
    "Sampler",
    "SamplerOutput",
    "SamplingRow",
    "filtered_probs",
    "is_greedy",
    "make_generator",
    "sample_from_logits",
]
