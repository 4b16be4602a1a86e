"""Helpers shared by engine tests: build engines on tiny models and run them to completion."""

from __future__ import annotations

from pathlib import Path

import torch

from loom.engine.config import EngineArgs
from loom.engine.llm_engine import LLMEngine
from loom.engine.outputs import RequestOutput


def make_engine(folder: Path, **kwargs) -> LLMEngine:
    """A float32 CPU engine on a model folder; kwargs override EngineArgs fields."""
    args = dict(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=256, block_size=4)
    args.update(kwargs)
    return LLMEngine.from_engine_args(EngineArgs(**args))


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    """Step until nothing runs; the last output of every request, by id."""
    last: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return last
        for out in engine.step():
            last[out.request_id] = out
    raise AssertionError("engine did not finish")


def settle_session(engine: LLMEngine, rid: str, max_steps: int = 1000) -> None:
    """Step until session `rid` is paused (its tokens computed, its last logits stored)."""
    for _ in range(max_steps):
        if engine.get_session(rid).status == "PAUSED":
            return
        engine.step()
    raise AssertionError(f"session {rid} never paused")


def session_logits(engine: LLMEngine, rid: str, tokens: list[int]) -> torch.Tensor:
    """The last logits of a fresh session over `tokens` (opened as `rid`, then closed)."""
    engine.add_request(rid, tokens, session=True)
    settle_session(engine, rid)
    logits = engine.get_logits(rid).clone()
    engine.close(rid)
    return logits


def prompt_ids(n: int, offset: int = 0, vocab: int = 500) -> list[int]:
    """A deterministic prompt of n token ids avoiding the special ids 0..2."""
    return [3 + (offset * 31 + i * 17) % (vocab - 3) for i in range(n)]


def liveness_bound(work_tokens: int) -> int:
    """Most engine steps a run may take for `work_tokens` tokens to compute or generate.

    Without preemption every step computes at least one token of work; recompute after a
    preemption is bounded by a small multiple of the work, never by the steps already taken.
    """
    return 20 + 3 * work_tokens
