"""The request body of OpenAI's embeddings route (`POST /v1/embeddings`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from loom.server.openai_requests import Prompt
from loom.server.request_base import LIMIT, ModelName, RequestBody

# An embedding's size: one the served model allows (none unless it is a matryoshka model).
Dimensions = Annotated[int, Field(ge=1, json_schema_extra={LIMIT: "dimensions"})]


class EmbeddingRequest(RequestBody):
    """`POST /v1/embeddings`: `input` is text, token ids, or a batch of either (one embedding
    each, in order). `dimensions` (matryoshka models only: their config says
    `is_matryoshka` or lists `matryoshka_dimensions`) keeps the first components before
    normalising. `normalize` is vLLM's extra; `pooling_type` Loom's ("last", the default of
    a causal LM, or "mean")."""

    model: ModelName
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Dimensions | None = None
    user: str | None = None
    normalize: bool = True
    pooling_type: Literal["last", "mean"] | None = None
