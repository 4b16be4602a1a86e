"""`SamplingRow`: what the sampler needs to know about one request of the batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loom.sampling_params import SamplingParams

# Temperatures below this are treated as greedy (dividing by them would overflow).
SAMPLING_EPS = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    """True when `params` asks for argmax (temperature 0, or too small to divide by)."""
    return params.temperature < SAMPLING_EPS


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator on `device` seeded with `seed`, for a request with `params.seed`."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingRow:
    """One request's row of the batch: its parameters, token history and random generator.

    `output_token_ids` are the tokens generated so far (they drive presence, frequency and
    min_tokens); `prompt_token_ids` join them for the repetition penalty. `generator` is the
    request's own seeded generator (None when `params.seed` is None); it must live on the
    same device as the logits. `eos_token_ids` are suppressed, together with
    `params.stop_token_ids`, until `min_tokens` tokens have been generated.
    """

    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    eos_token_ids: set[int] = field(default_factory=set)

    @property
    def greedy(self) -> bool:
        """True when this row takes the argmax."""
        return is_greedy(self.params)

    @property
    def has_penalties(self) -> bool:
        """True when any repetition, presence or frequency penalty applies."""
        p = self.params
        return (
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        )

    def suppressed_token_ids(self) -> list[int]:
        """Tokens masked this step: stop tokens and eos (unless ignore_eos) before min_tokens.

        vLLM semantics: `ignore_eos` only keeps eos out of the set; explicit
        `stop_token_ids` are still suppressed until `min_tokens` is reached.
        """
        p = self.params
        if len(self.output_token_ids) >= p.min_tokens:
            return []
        ids = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            ids |= self.eos_token_ids
        return sorted(ids)
