"""A request's structured-output constraint: OpenAI's `response_format`, vLLM's
`structured_outputs`, or a forced tool call (`tools.py` builds that one), checked to compile
before anything is queued.

`response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON
object), `{"type": "json_schema", "json_schema": {"schema": {...}}}` (JSON following the
schema; always enforced, `strict` or not). JSON is compact: small models cannot pad it with
whitespace forever.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from loom.errors import InvalidRequestError, LoomError
from loom.sampling_params import SamplingParams, StructuredOutputsParams
from loom.server.protocol import ConstraintFields
from loom.server.tools import ToolPlan


def requested_constraint(body: ConstraintFields) -> tuple[StructuredOutputsParams | None, str]:
    """The constraint `response_format` or `structured_outputs` asks for (None: free text) and
    the field that asked (for errors); an InvalidRequestError naming the field when it is
    malformed or when both ask."""
    fmt, vllm = body.response_format, body.structured_outputs
    if fmt is not None and fmt.type != "text" and vllm is not None:
        raise InvalidRequestError("give response_format or structured_outputs, not both",
                                  param="structured_outputs", code="invalid_request")
    if vllm is not None:
        try:
            return StructuredOutputsParams(
                json=vllm.json_, json_object=bool(vllm.json_object), regex=vllm.regex,
                grammar=vllm.grammar, choice=vllm.choice), "structured_outputs"
        except LoomError as error:
            raise InvalidRequestError(str(error), param="structured_outputs",
                                      code="invalid_request") from None
    if fmt is None or fmt.type == "text":
        return None, "response_format"
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise InvalidRequestError("response_format of type 'json_schema' needs "
                                  "json_schema.schema (a JSON schema object)",
                                  param="response_format", code="invalid_request")
    return StructuredOutputsParams(json=fmt.json_schema.schema_), "response_format"


async def check_constraint(engine: Any, params: SamplingParams, param: str) -> None:
    """A 400 naming `param` unless the parameters' constraint compiles (the engine would
    refuse it later, after a session's fragment was already appended). Compiled off the event
    loop: the first compilation builds the grammar library's vocabulary (seconds)."""
    if params.structured_outputs is None:
        return
    try:
        await asyncio.to_thread(engine.inputs.check_params, param, params)
    except LoomError as error:
        # "request 'x': invalid structured_outputs (json): why" -> "invalid tools (json): why"
        detail = re.sub(r"^request '[^']*': invalid structured_outputs:? ?", "", str(error))
        raise InvalidRequestError(f"invalid {param} {detail}", param=param,
                                  code="invalid_value") from None


async def constrain(state: Any, params: SamplingParams, requested: StructuredOutputsParams | None,
                    param: str, tools: ToolPlan | None = None) -> SamplingParams:
    """`params` under the request's constraint: the forced tool call's grammar, else the
    requested one; each checked to compile first (an InvalidRequestError naming `tools` or
    `param`). Offered tools' parameter schemas are checked even when no call is forced."""
    if tools is not None and tools.offered:
        # The end token follows the calls unless the sampler may not end (it would be stuck).
        can_end = not params.ignore_eos and params.min_tokens == 0
        forced = tools if tools.forced is not None else ToolPlan(
            tools.offered, "required", tools.parallel)
        grammar = forced.constraint(state.end_token_ids if can_end else ())
        await check_constraint(state.engine, params.with_updates(structured_outputs=grammar),
                               "tools")
        if tools.forced is not None:
            return params.with_updates(structured_outputs=grammar)
    params = params.with_updates(structured_outputs=requested)
    await check_constraint(state.engine, params, param)
    return params


async def constrain_chat(state: Any, params: SamplingParams,
                         requested: StructuredOutputsParams | None, param: str,
                         tools: ToolPlan | None = None) -> SamplingParams:
    """`constrain` for a chat output (chat completions, Responses): a harmony model's output
    is held to its format instead (`harmony_chat.HarmonyChat.held_to_format`: the grammar
    constrains a call's arguments and the final message, and the format's tokens end it),
    checked to compile (a 400 naming `tools` when tools are offered, else `param`)."""
    if state.harmony is None:
        return await constrain(state, params, requested, param, tools)
    params = state.harmony.held_to_format(params, tools, requested)
    await check_constraint(state.engine, params,
                           "tools" if tools is not None and tools.offered else param)
    return params
