"""Embedding requests: their outputs (vLLM's `EmbeddingRequestOutput` shape) and the
`Pooler` that folds the runner's pooled rows into one vector per request.

An embedding request is a prompt-only request that samples nothing. The scheduler chunks its
prompt like any other; each chunk carries its pooling kind and yields one float64 row from
the runner (`loom.runner.model_runner.pool_rows`): the sum of its hidden states ("mean") or
its last one ("last"). Once a chunk reaches the end of the prompt, the request's vector is
complete:

    mean:  sum over chunks / num_prompt_tokens       (chunks cover [0, n) in order)
    last:  the last chunk's row
    then:  first `dimensions` components, L2-normalised when `normalize`, as float32
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from loom.core.scheduler_output import ScheduledChunk
from loom.engine.outputs import RequestOutput
from loom.errors import InvalidRequestError
from loom.pooling_params import PoolingParams


@dataclass
class EmbeddingOutput:
    """One request's embedding: float32 values as Python floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        """The embedding's length."""
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """The one output of an embedding request (vLLM's shape): `outputs.embedding`."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def segment_finished(self) -> bool:
        """Always True: the request ends with this output."""
        return True


# What a step hands back per request: a generating request's output or an embedding.
EngineOutput = RequestOutput | EmbeddingRequestOutput


def allowed_dimensions(hidden_size: int, hf_config: dict[str, Any]) -> list[int]:
    """The values `PoolingParams.dimensions` may take on a model: its config's
    `matryoshka_dimensions` (those up to the hidden size), or with `is_matryoshka: true`
    alone every size up to the hidden size; none for any other model (vLLM's rule: only
    matryoshka models take `dimensions`)."""
    sizes = hf_config.get("matryoshka_dimensions")
    if sizes:
        return sorted({int(s) for s in sizes if 0 < int(s) <= hidden_size})
    if hf_config.get("is_matryoshka"):
        return list(range(1, hidden_size + 1))
    return []


def check_dimensions(params: PoolingParams, allowed: Sequence[int]) -> None:
    """An `InvalidRequestError` naming `dimensions` unless `params.dimensions` is one of the
    model's `allowed` sizes (see `allowed_dimensions`)."""
    wanted = params.dimensions
    if wanted is None:
        return
    if not allowed:
        raise InvalidRequestError(
            "invalid pooling parameter dimensions: this model does not support matryoshka "
            "embeddings (its config sets neither is_matryoshka nor matryoshka_dimensions)")
    if wanted not in allowed:
        sizes = (f"at most {len(allowed)}" if list(allowed) == list(range(1, len(allowed) + 1))
                 else f"one of {list(allowed)}")
        raise InvalidRequestError(
            f"invalid pooling parameter dimensions: {wanted} is not supported by this model "
            f"(it must be {sizes})")


def finish_vector(pooled: torch.Tensor, params: PoolingParams) -> list[float]:
    """The pooled float64 vector cut to `dimensions`, normalised when asked, as floats of
    float32 precision."""
    vector = pooled[: params.dimensions] if params.dimensions else pooled
    if params.normalize:
        vector = vector / vector.norm().clamp_min(1e-12)
    return vector.float().tolist()


@dataclass
class _Pooling:
    params: PoolingParams
    total: torch.Tensor | None = None  # mean: the sum of the rows of [0, next_pos)
    next_pos: int = 0


class Pooler:
    """Per embedding request: its parameters and what its chunks pooled so far."""

    def __init__(self) -> None:
        self._requests: dict[str, _Pooling] = {}

    def add(self, request_id: str, params: PoolingParams) -> None:
        """Start pooling a request's prompt."""
        self._requests[request_id] = _Pooling(params)

    def drop(self, request_id: str) -> None:
        """Forget a request (it ended, or failed)."""
        self._requests.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def take(self, chunk: ScheduledChunk, row: torch.Tensor, num_tokens: int
             ) -> list[float] | None:
        """Fold a chunk's pooled row in; the embedding when the chunk ends the request's
        `num_tokens` tokens (the request is then forgotten), else None."""
        state = self._requests[chunk.request_id]
        if chunk.pooling == "mean":
            # A mean request takes nothing from caches: its chunks cover the prompt in order,
            # from 0 again after a preemption.
            if chunk.start_pos == 0:
                state.total, state.next_pos = None, 0
            if chunk.start_pos != state.next_pos:
                raise RuntimeError(f"request {chunk.request_id}: pooling chunk starts at "
                                   f"{chunk.start_pos}, expected {state.next_pos}")
            state.total = row if state.total is None else state.total + row
            state.next_pos = chunk.end_pos
        if chunk.end_pos < num_tokens:
            return None
        del self._requests[chunk.request_id]
        if chunk.pooling == "mean":
            assert state.total is not None
            return finish_vector(state.total / num_tokens, state.params)
        return finish_vector(row, state.params)
