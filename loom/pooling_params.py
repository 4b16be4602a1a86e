"""`PoolingParams`: how an embedding request pools its prompt (vLLM's field names)."""

from __future__ import annotations

from dataclasses import dataclass

from loom.errors import InvalidRequestError

# The pooling kinds: the last prompt token's hidden state, or the mean over the prompt.
POOLING_TYPES = ("last", "mean")
# What a causal LM without a pooling config pools (vLLM's default for such a model).
DEFAULT_POOLING_TYPE = "last"


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request's parameters.

    `pooling_type`: "last" or "mean" (any case; None: the default, "last"); Loom's
    per-request choice of what vLLM sets per model (`--override-pooler-config`).
    `normalize`: L2-normalise the pooled vector (vLLM's default True). `dimensions`: keep only
    the first `dimensions` components before normalising (matryoshka embeddings; the engine
    accepts it only for models whose config says they support it)."""

    pooling_type: str | None = None
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        kind = self.pooling_type
        if kind is not None and (not isinstance(kind, str) or kind.lower() not in POOLING_TYPES):
            raise InvalidRequestError(
                f"invalid pooling parameter pooling_type: {kind!r} is not one of "
                f"{', '.join(POOLING_TYPES)}")
        if self.dimensions is not None and (
                isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                or self.dimensions < 1):
            raise InvalidRequestError(
                f"invalid pooling parameter dimensions: must be a positive integer, got "
                f"{self.dimensions!r}")

    @property
    def pooling(self) -> str:
        """The pooling kind in effect: "last" or "mean"."""
        return (self.pooling_type or DEFAULT_POOLING_TYPE).lower()
