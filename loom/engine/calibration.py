"""The step-cost model's start-up calibration, for an engine with a time budget per step
(`max_step_ms`): a few timed steps before the first request, so the budget holds from the
first prompt instead of after a few steps sized by the token budget alone.

Prompts of a few lengths are each computed alone as one chunk and followed by two decode
steps; the engine core feeds every step's measured time to the cost model as for any step
(`EngineCore._observe_step`), and the fit is refined by the real steps that follow. The
prompts' blocks are dropped from the prefix cache afterwards; their steps count in the
engine's counters (steps, computed tokens) and step-time histogram.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from loom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Prompt lengths (tokens) of the calibration steps, cut to the engine's token budget.
CALIBRATION_PROMPTS = (8, 32, 96, 192)
_DECODES = 2


class CalibratedEngine(Protocol):
    """What the calibration uses of an engine (`LLMEngine`)."""

    config: Any
    scheduler: Any
    inputs: Any

    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    sampling_params: SamplingParams | None = None) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[Any]: ...

    def reset_prefix_cache(self) -> int: ...


def calibrate_step_cost(engine: CalibratedEngine) -> None:
    """Run the calibration steps (see the module docstring) and log the fitted model."""
    cost = engine.scheduler.cost
    if cost is None:
        return
    config = engine.config
    budget = config.scheduler.max_num_batched_tokens
    room = config.max_model_len - _DECODES - 1
    lengths = sorted({min(n, budget, room) for n in CALIBRATION_PROMPTS if room > 0})
    vocab = engine.inputs.vocab_size
    # Ordinary token ids from the middle of the vocabulary (no special tokens).
    ids = [vocab // 2 + (i * 7919) % max(1, vocab // 4) for i in range(max(lengths, default=0))]
    params = SamplingParams(temperature=0.0, max_tokens=_DECODES + 1, ignore_eos=True)
    began = time.perf_counter()
    for i, n in enumerate(lengths):
        rid = f"loom-step-calibration-{i}"
        engine.add_request(rid, ids[:n], params)
        while engine.has_unfinished_requests():
            engine.step()
    engine.reset_prefix_cache()
    logger.info("step cost calibrated in %.2f s (%d steps): %.1f ms a step + %.3f ms a token%s",
                time.perf_counter() - began, len(lengths) * (_DECODES + 1), cost.fixed_ms(),
                cost.chunk_ms(1, 0), "" if cost.calibrated else " (not yet usable)")
