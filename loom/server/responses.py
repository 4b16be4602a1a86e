"""Response bodies in OpenAI's shapes, built from the engine's `RequestOutput`s.

Streaming forwards the engine's DELTA outputs: per step, the text each choice gained (the
engine holds back the tail a stop string may still cut), then a final chunk with
`finish_reason`, optional usage, and `data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from loom.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from loom.server.wire import json_text


def usage(output: RequestOutput) -> dict[str, int]:
    """OpenAI's `usage` of a request's output."""
    prompt = len(output.prompt_token_ids)
    completion = sum(len(o.token_ids) for o in output.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _sampled_logprob(position: dict[int, float], token_id: int) -> float:
    return position.get(token_id, float("-inf"))


def _top(position: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(position.items(), key=lambda kv: -kv[1])[:n]


def completion_logprobs(
    completion: CompletionOutput, decode: Callable[[int], str], top_n: int,
    start: int = 0, text_offset: int = 0,
) -> dict[str, Any] | None:
    """The completions API's `logprobs` object for tokens [start:] of a completion."""
    if completion.logprobs is None:
        return None
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for token_id, position in zip(completion.token_ids[start:], completion.logprobs[start:],
                                  strict=False):
        text = decode(token_id)
        tokens.append(text)
        token_logprobs.append(_sampled_logprob(position, token_id))
        top_logprobs.append({decode(t): lp for t, lp in _top(position, top_n)} if top_n else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs, "text_offset": offsets}


def prompt_logprobs_object(
    prompt_ids: list[int], entries: list[PositionLogprobs | None], decode: Callable[[int], str],
    top_n: int,
) -> dict[str, Any]:
    """The completions API's `logprobs` object for an echoed prompt (the first token has no
    logprob: `None`, as OpenAI's); text offsets count from the prompt's start."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    for token_id, position in zip(prompt_ids, entries, strict=True):
        text = decode(token_id)
        tokens.append(text)
        token_logprobs.append(None if position is None else _sampled_logprob(position, token_id))
        top_logprobs.append({decode(t): lp for t, lp in _top(position, top_n)}
                            if top_n and position is not None else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs, "text_offset": offsets}


def joined_logprobs(first: dict[str, Any], second: dict[str, Any] | None) -> dict[str, Any]:
    """Two `logprobs` objects one after the other (an echoed prompt, then its completion)."""
    if second is None:
        return first
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(entries: list[PositionLogprobs | None] | None,
                         decode: Callable[[int], str], top_n: int
                         ) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt position None (the first) or {token id:
    {"logprob", "rank" (1-based among the `top_n` most likely; None for a prompt token
    outside them), "decoded_token"}}."""
    if entries is None:
        return None
    out: list[dict[str, Any] | None] = []
    for position in entries:
        if position is None:
            out.append(None)
            continue
        ranked = sorted(position.items(), key=lambda kv: -kv[1])
        out.append({str(t): {"logprob": lp, "rank": i + 1 if i < top_n else None,
                             "decoded_token": decode(t)}
                    for i, (t, lp) in enumerate(ranked)})
    return out


def chat_logprobs(
    completion: CompletionOutput, decode: Callable[[int], str], top_n: int, start: int = 0
) -> dict[str, Any] | None:
    """The chat API's `logprobs` object (`content`: one entry per token) for tokens [start:]."""
    if completion.logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, position in zip(completion.token_ids[start:], completion.logprobs[start:],
                                  strict=False):
        item = entry(token_id, _sampled_logprob(position, token_id))
        item["top_logprobs"] = [entry(t, lp) for t, lp in _top(position, top_n)]
        content.append(item)
    return {"content": content}


def sse(data: dict[str, Any] | str) -> str:
    """One Server-Sent Event (a dict as strict JSON: a logprob of -inf is null)."""
    payload = data if isinstance(data, str) else json_text(data)
    return f"data: {payload}\n\n"


def now() -> int:
    """Seconds since the epoch, as OpenAI's `created`."""
    return int(time.time())


def request_tree(out: RequestOutput) -> list[dict[str, Any]]:
    """The `<promise>` children of an output, recursively (empty without the hook)."""
    return [{"id": child.request_id,
             "text": child.outputs[0].text if child.outputs else "",
             "token_ids": child.outputs[0].token_ids if child.outputs else [],
             "finish_reason": child.outputs[0].finish_reason if child.outputs else None,
             "children": request_tree(child)} for child in out.children]
