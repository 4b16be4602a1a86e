"""OpenAI's embeddings (`POST /v1/embeddings`): each input's pooled final hidden state.

Every input is one embedding request of the engine (`PoolingParams`); they run together,
batched with whatever else the engine serves. Base64 embeddings are the little-endian float32
bytes of the vector, as OpenAI's clients decode them."""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any

from fastapi import APIRouter, Depends, Request

from loom.engine.pooling import EmbeddingRequestOutput
from loom.errors import InvalidRequestError, LoomError
from loom.pooling_params import PoolingParams
from loom.server.embedding_requests import EmbeddingRequest
from loom.server.errors import APIError
from loom.server.http_requests import authenticated, get_state, unless_disconnected
from loom.server.state import ServerState

router = APIRouter()


def _inputs(state: ServerState, given: Any) -> list[list[int]]:
    """`input` as token-id lists (text tokenised with BOS, as a prompt), each non-empty, in
    the vocabulary and within the context limit (400s naming `input`)."""
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        given = [given]
    if not given or any(not item for item in given):
        raise APIError(400, "input must not be empty", param="input")
    inputs = state.engine.inputs
    out: list[list[int]] = []
    for item in given:
        try:
            ids = (inputs.tokenizer.encode(item, add_special_tokens=True)
                   if isinstance(item, str) else list(item))
            inputs.check_token_ids("input", ids)
        except LoomError as error:
            raise APIError(400, str(error), param="input") from None
        if len(ids) > state.max_model_len:
            raise APIError(400, f"an input has {len(ids)} tokens; this model's context limit "
                                f"is {state.max_model_len} tokens", param="input",
                           code="context_length_exceeded")
        out.append(ids)
    return out


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """The embedding as floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


@router.post("/v1/embeddings")
async def create_embedding(body: EmbeddingRequest, request: Request,
                           key: str = Depends(authenticated)) -> Any:
    """OpenAI's embeddings: one vector per input, L2-normalised unless `normalize` is off."""
    state = get_state(request)
    state.check_model(body.model)
    inputs = _inputs(state, body.input)
    params = PoolingParams(pooling_type=body.pooling_type, normalize=body.normalize,
                           dimensions=body.dimensions)
    try:
        state.engine.check_pooling_params(params)
    except InvalidRequestError as error:  # the model does not take these dimensions
        raise APIError(400, str(error), param="dimensions") from None
    outs: list[EmbeddingRequestOutput] = await unless_disconnected(
        request, asyncio.gather(*(state.engine.embed(item, params) for item in inputs)))
    data = []
    for index, out in enumerate(outs):
        if out.error is not None:
            # The engine could not serve it (KV pool held by pinned sessions, a failed step).
            raise APIError(503, out.error, code="request_failed")
        data.append({"object": "embedding", "index": index,
                     "embedding": _encoded(out.outputs.embedding, body.encoding_format)})
    tokens = sum(len(out.prompt_token_ids) for out in outs)
    return {"object": "list", "data": data, "model": body.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
