"""OpenAI's endpoints: completions, chat completions (both streaming), models, tokenize."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from loom.engine.outputs import OutputAccumulator, RequestOutput
from loom.errors import LoomError
from loom.server import chat_output, tool_calls
from loom.server.constraints import constrain, constrain_chat, requested_constraint
from loom.server.errors import APIError, as_api_error, error_body
from loom.server.http_requests import authenticated, get_state, unless_disconnected
from loom.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from loom.server.responses import (
    chat_logprobs,
    completion_logprobs,
    joined_logprobs,
    now,
    prompt_logprobs_object,
    request_tree,
    sse,
    usage,
    vllm_prompt_logprobs,
)
from loom.server.state import ServerState
from loom.server.tools import plan_tools

router = APIRouter()


def _prompts(state: ServerState, prompt: Any) -> list[tuple[str | None, list[int]]]:
    """`prompt` as (text, token ids) pairs: a string, token ids, or a list of either;
    tokenised and checked by the engine's input processor (the engine's own rules)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    inputs = state.engine.inputs
    out = []
    for item in prompt:
        if not item:
            raise APIError(400, "prompt must not be empty", param="prompt")
        try:
            # The context limit is checked with max_tokens (state.max_tokens), as a 400.
            if isinstance(item, str):
                out.append((item, inputs.tokenizer.encode(item, add_special_tokens=True)))
            else:
                inputs.check_token_ids("prompt", item)
                out.append((None, list(item)))
        except LoomError as error:
            raise APIError(400, str(error), param="prompt") from None
    return out


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, Any]]:
    """Items of several streams as they come, tagged with the stream's index."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except BaseException as exc:  # delivered to the consumer, which re-raises it
            await queue.put((i, exc))
            return
        await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _gathered(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """A request's whole output from its deltas."""
    gathered = OutputAccumulator()
    async for out in stream:
        gathered.add(out)
    return gathered.result()


def _sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except Exception as error:  # after the headers: report in the stream, then end it
            failure = as_api_error(error)
            yield sse(error_body(failure.status, failure.message, failure.param, failure.code))
        yield sse("[DONE]")

    return StreamingResponse(guarded(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request,
                            key: str = Depends(authenticated)) -> Any:
    """OpenAI's completions: a prompt (or several) continued, optionally streamed."""
    state = get_state(request)
    state.check_model(body.model)
    # max_tokens 0 (with echo) scores the prompt: one token is generated and dropped (its
    # logits are the prompt's last row, computed anyway).
    score_only = body.max_tokens == 0
    if score_only and not body.echo:
        raise APIError(400, "max_tokens=0 generates nothing: it needs echo=true",
                       param="max_tokens", code="invalid_value")
    prompts = _prompts(state, body.prompt)
    cid = f"cmpl-{uuid.uuid4().hex}"
    constraint, field = requested_constraint(body)
    limits = [state.max_tokens(1 if score_only else body.max_tokens, len(ids))
              for _, ids in prompts]
    # One constraint for every prompt: checked to compile once.
    constrained = await constrain(state, body.sampling_params(None, body.logprobs),
                                  constraint, field)
    prompt_top = body.prompt_logprobs_wanted()
    params = [constrained.with_updates(max_tokens=limit, prompt_logprobs=prompt_top)
              for limit in limits]
    streams = [state.stream(ids, p, f"{cid}-{i}")
               for i, ((_, ids), p) in enumerate(zip(prompts, params, strict=True))]
    decode = state.decode_token
    top_n = body.logprobs or 0

    def echo_text(i: int) -> str:
        text, ids = prompts[i]
        return text if text is not None else state.tokenizer.decode(ids)

    def choice_logprobs(i: int, out: RequestOutput, comp: Any, start: bool
                        ) -> dict[str, Any] | None:
        """A choice's `logprobs`: its tokens' (none when only scoring), after the echoed
        prompt's when `start` (the choice's first text) and echo is on."""
        if body.logprobs is None:
            return None
        if not (start and body.echo):
            return None if score_only else completion_logprobs(comp, decode, top_n)
        own = None if score_only else completion_logprobs(comp, decode, top_n,
                                                          text_offset=len(echo_text(i)))
        assert out.prompt_logprobs is not None  # asked for with echo and logprobs
        echoed = prompt_logprobs_object(prompts[i][1], out.prompt_logprobs, decode, top_n)
        return joined_logprobs(echoed, own)

    def generated(comp: Any) -> tuple[str, str | None, Any]:
        """(text, finish reason, stop reason) of a choice, nothing when only scoring."""
        if score_only:
            return "", "length", None
        return comp.text, comp.finish_reason, comp.stop_reason

    def summed_usage(outs: list[RequestOutput]) -> dict[str, int]:
        """`usage` over the prompts' outputs (no completion tokens when only scoring)."""
        total = [usage(o) for o in outs]
        if score_only:
            total = [{**u, "completion_tokens": 0, "total_tokens": u["prompt_tokens"]}
                     for u in total]
        return {k: sum(u[k] for u in total) for k in total[0]}

    def prompt_logprobs_field(out: RequestOutput) -> dict[str, Any]:
        if body.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(out.prompt_logprobs, decode,
                                                        body.prompt_logprobs)}

    if not body.stream:
        outs = await unless_disconnected(
            request, asyncio.gather(*(_gathered(s) for s in streams)))
        choices = []
        for i, out in enumerate(outs):
            for comp in out.outputs:
                text, reason, stop = generated(comp)
                choices.append({
                    "index": i * body.n + comp.index,
                    "text": (echo_text(i) if body.echo else "") + text,
                    "logprobs": choice_logprobs(i, out, comp, start=True),
                    "finish_reason": reason,
                    "stop_reason": stop,
                    **prompt_logprobs_field(out),
                })
        response = {"id": cid, "object": "text_completion", "created": now(),
                    "model": body.model, "choices": choices, "usage": summed_usage(outs)}
        trees = [request_tree(o) for o in outs]
        if any(trees):  # `<promise>` children (Loom's extension), per prompt
            response["children"] = trees
        return response

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events() -> AsyncIterator[str]:
        gathered = [OutputAccumulator() for _ in streams]
        last: dict[int, RequestOutput] = {}
        created = now()
        # The echoed prompt goes first; with logprobs it waits for the prompt's (they come
        # with the prompt's first output).
        echo_first = body.echo and body.logprobs is None
        if echo_first:
            for i in range(len(prompts)):
                for j in range(body.n):
                    yield sse({"id": cid, "object": "text_completion", "created": created,
                               "model": body.model, "choices": [{
                                   "index": i * body.n + j, "text": echo_text(i),
                                   "logprobs": None, "finish_reason": None}]})
        async for i, out in _merged(streams):
            first = i not in last
            last[i] = out
            gathered[i].add(out)
            for comp in out.outputs:  # deltas: the engine held back what a stop may cut
                text, reason, stop = generated(comp)
                finished = reason is not None
                echo_now = first and body.echo and not echo_first
                if not text and not finished and not echo_now:
                    continue
                yield sse({"id": cid, "object": "text_completion", "created": created,
                           "model": body.model, "choices": [{
                               "index": i * body.n + comp.index,
                               "text": (echo_text(i) if echo_now else "") + text,
                               "logprobs": choice_logprobs(i, out, comp, start=echo_now),
                               "finish_reason": reason if finished else None,
                               "stop_reason": stop if finished else None,
                               **(prompt_logprobs_field(out) if first else {})}]})
        trees = [request_tree(last[i]) if i in last else [] for i in range(len(streams))]
        if any(trees):  # `<promise>` children, once every choice has finished
            yield sse({"id": cid, "object": "text_completion", "created": created,
                       "model": body.model, "choices": [], "children": trees})
        if include_usage:
            yield sse({"id": cid, "object": "text_completion", "created": created,
                       "model": body.model, "choices": [],
                       "usage": summed_usage([g.result() for g in gathered if g.has_output])})

    return _sse_response(events())


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 key: str = Depends(authenticated)) -> Any:
    """OpenAI's chat completions: messages through the chat template, optionally streamed."""
    state = get_state(request)
    state.check_model(body.model)
    constraint, field = requested_constraint(body)
    tools = plan_tools(body, constrained=constraint is not None)
    ids = state.chat_ids(body.messages, body.add_generation_prompt,
                         tools if tools.offered else None, body.chat_template_kwargs,
                         body.reasoning_effort)
    requested = body.max_completion_tokens or body.max_tokens
    top_n = body.top_logprobs or 0
    params = await constrain_chat(
        state, body.sampling_params(state.max_tokens(requested, len(ids)),
                                    top_n if body.logprobs else None),
        constraint, field, tools)
    params = params.with_updates(prompt_logprobs=body.prompt_logprobs)
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    stream = state.stream(ids, params, cid)
    decode = state.decode_token
    names = tools.names if tools.parses else None  # None: the text is all content
    constrained = params.structured_outputs is not None

    if not body.stream:
        out = await unless_disconnected(request, _gathered(stream))
        choices, thoughts = [], []
        for comp in out.outputs:
            message = chat_output.message(state.output_split(ids, constrained, names),
                                          comp.text, comp.token_ids, names is not None)
            thoughts.append(message.get("reasoning_content") or "")
            choices.append({
                "index": comp.index, "message": message,
                "logprobs": chat_logprobs(comp, decode, top_n) if body.logprobs else None,
                "finish_reason": tool_calls.finish_reason(
                    comp.finish_reason, len(message.get("tool_calls", ()))),
                "stop_reason": comp.stop_reason})
        return {"id": cid, "object": "chat.completion", "created": now(), "model": body.model,
                "choices": choices,
                "usage": chat_output.usage(usage(out), state.reasoning_tokens(thoughts)),
                **({"prompt_logprobs": vllm_prompt_logprobs(out.prompt_logprobs, decode,
                                                            body.prompt_logprobs)}
                   if body.prompt_logprobs is not None else {}),
                **({"children": request_tree(out)} if out.children else {})}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    # Each choice's output split by its format: reasoning, then content and calls (with
    # tools, what may be a call is held back and each call is given whole: chat_output.py).
    writers = [chat_output.ChoiceDeltas(state.output_split(ids, constrained, names))
               for _ in range(body.n)]

    async def events() -> AsyncIterator[str]:
        created, gathered, last = now(), OutputAccumulator(), None

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            return sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                        "model": body.model, "choices": choices, **extra})

        # With tools the content stays null (as a whole response's) unless text comes.
        opening = {"role": "assistant", "content": "" if names is None else None}
        yield chunk([{"index": i, "delta": opening, "logprobs": None, "finish_reason": None}
                     for i in range(body.n)])
        async for out in stream:
            last = out
            gathered.add(out)
            for comp in out.outputs:  # deltas: the engine held back what a stop may cut
                finished = comp.finish_reason is not None
                writer = writers[comp.index]
                parts = writer.deltas(comp.text, comp.token_ids, finished)
                if not parts and (finished or (body.logprobs and comp.token_ids)):
                    parts = [{}]  # the finish reason, or logprobs of held-back text
                reason = comp.finish_reason
                if finished and names is not None:
                    reason = tool_calls.finish_reason(reason, writer.calls)
                for k, delta in enumerate(parts):
                    yield chunk([{"index": comp.index, "delta": delta,
                                  "logprobs": chat_logprobs(comp, decode, top_n)
                                  if body.logprobs and k == 0 else None,
                                  "finish_reason": reason
                                  if finished and k == len(parts) - 1 else None}])
        if last is not None and last.children:  # `<promise>` children, after the text
            yield chunk([], children=request_tree(last))
        if include_usage and last is not None:
            thoughts = [w.reasoning_text for w in writers]
            yield chunk([], usage=chat_output.usage(usage(gathered.result()),
                                                    state.reasoning_tokens(thoughts)))

    return _sse_response(events())


def _model_card(state: ServerState) -> dict[str, Any]:
    """OpenAI's model object for the served model."""
    return {"id": state.config.served_model_name, "object": "model", "created": now(),
            "owned_by": "loom", "max_model_len": state.max_model_len}


@router.get("/v1/models")
async def list_models(request: Request, key: str = Depends(authenticated)) -> Any:
    """The one model this server serves."""
    return {"object": "list", "data": [_model_card(get_state(request))]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request,
                         key: str = Depends(authenticated)) -> Any:
    """OpenAI's model retrieval: the served model, or a 404 in OpenAI's error shape (an id
    may hold slashes, as Hugging Face names do)."""
    state = get_state(request)
    state.check_model(model_id)
    return _model_card(state)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request,
                   key: str = Depends(authenticated)) -> Any:
    """Token ids of a prompt, or of messages through the chat template."""
    state = get_state(request)
    state.check_model(body.model)
    prompt = state.prompt_or_messages(body.prompt, body.messages, tools=body.tools)
    ids = prompt if isinstance(prompt, list) else state.tokenizer.encode(
        prompt, add_special_tokens=body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, key: str = Depends(authenticated)) -> Any:
    """vLLM's tokenizer description (what clients that tokenise through the server, such
    as lm-evaluation-harness's remote tokenizer, read): the special tokens' text, the chat
    template in use, the context limit."""
    state = get_state(request)
    tokenizer = state.tokenizer

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.convert_ids_to_tokens([token_id])[0]

    template = state.chat_template
    return {"tokenizer_class": "LoomTokenizer", "eos_token": text(tokenizer.eos_token_id),
            "bos_token": text(tokenizer.bos_token_id),
            "pad_token": text(tokenizer.pad_token_id),
            "add_bos_token": tokenizer.add_bos_token,
            "chat_template": template.template if template is not None else None,
            "model_max_length": state.max_model_len, "vocab_size": tokenizer.vocab_size}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request,
                     key: str = Depends(authenticated)) -> Any:
    """Text of token ids."""
    state = get_state(request)
    state.check_model(body.model)
    try:
        state.engine.inputs.check_token_ids("detokenize", body.tokens)
    except LoomError as error:
        raise APIError(400, str(error), param="tokens") from None
    return {"prompt": state.tokenizer.decode(body.tokens)}
