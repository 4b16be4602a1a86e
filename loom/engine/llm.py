"""`LLM`: the offline batch API (vLLM's shape): `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from loom.engine.config import EngineArgs
from loom.engine.llm_engine import LLMEngine
from loom.engine.outputs import CompletionOutput, RequestOutput
from loom.engine.pooling import EmbeddingOutput, EmbeddingRequestOutput, EngineOutput
from loom.errors import InvalidRequestError, LoomError, PromptTooLongError
from loom.pooling_params import PoolingParams
from loom.sampling_params import RequestOutputKind, SamplingParams

# Show a progress bar by default only past this many prompts.
_TQDM_MIN_PROMPTS = 8

Prompt = str | Sequence[int]
# vLLM's TextPrompt / TokensPrompt: {"prompt": text} or {"prompt_token_ids": ids}.
PromptDict = dict[str, Any]


class LLM:
    """Run batches of prompts to completion; accepts every `EngineArgs` field as a keyword."""

    def __init__(self, model: str = "gemma3-270m", **kwargs: Any) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=model, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer."""
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer (vLLM's `LLM.get_tokenizer()`): `encode`, `decode`,
        `eos_token_ids`, and the chat template's inputs."""
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """The synchronous engine inside (vLLM's `LLM.llm_engine`)."""
        return self.engine

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV block (see `LLMEngine.reset_prefix_cache`)."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Release the engine (stops tensor-parallel workers; also done at exit)."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's `{"prompt": ...}` /
        `{"prompt_token_ids": [...]}`); outputs come back in prompt order.

        A prompt that cannot be accepted (over the context limit) yields an output with
        `finish_reason="error"` and the message in `error`; the others still run.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = [  # one output per request, when it finishes: no per-step copies
            p.with_updates(output_kind=RequestOutputKind.FINAL_ONLY)
            for p in _per_prompt(sampling_params, SamplingParams, len(prompt_list), "sampling")]
        return self._run_all(prompt_list, params_list, use_tqdm)  # type: ignore[return-value]

    def embed(
        self,
        prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (vLLM's `LLM.embed`): `out.outputs.embedding`, in prompt
        order. A prompt over the context limit, or one whose request failed, yields an output
        with an empty embedding and the message in `error`."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _per_prompt(pooling_params, PoolingParams, len(prompt_list), "pooling")
        return [_as_embedding(out) for out in self._run_all(prompt_list, params_list, use_tqdm)]

    def _run_all(self, prompt_list: list[Any], params_list: list[Any],
                 use_tqdm: bool | None) -> list[EngineOutput]:
        """Add one request per prompt and run them all; their final outputs in prompt order
        (a prompt over the context limit: an error output, the others still run)."""
        results: dict[str, EngineOutput] = {}
        order: list[str] = []
        for prompt, params in zip(prompt_list, params_list, strict=True):
            request_id = f"llm-{next(self._ids)}"
            order.append(request_id)
            try:
                self.engine.add_request(request_id, prompt, params)
            except PromptTooLongError as exc:
                results[request_id] = _error_output(request_id, prompt, exc)
        show = use_tqdm if use_tqdm is not None else len(prompt_list) > _TQDM_MIN_PROMPTS
        self._run(results, len(order), show)
        return [results[rid] for rid in order]

    def _run(self, results: dict[str, EngineOutput], total: int, show: bool) -> None:
        bar = None
        if show:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
            bar.update(len(results))
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()


def _per_prompt(params: Any, default: Callable[[], Any], count: int, kind: str) -> list[Any]:
    """One parameters object per prompt: a single one (or None: `default()`) for all, or a
    sequence of exactly `count`."""
    if params is None or not isinstance(params, Sequence):
        return [params or default()] * count
    params_list = list(params)
    if len(params_list) != count:
        raise ValueError(f"got {len(params_list)} {kind} params for {count} prompts")
    return params_list


def _as_prompt_list(prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict]
                    ) -> list[Prompt]:
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # a single prompt given as token ids
    return [_from_dict(item) if isinstance(item, dict) else item for item in items]


def _from_dict(item: PromptDict) -> Prompt:
    """vLLM's prompt dicts: {"prompt": text} or {"prompt_token_ids": ids}."""
    if set(item) == {"prompt_token_ids"}:
        return list(item["prompt_token_ids"])
    if set(item) == {"prompt"}:
        return item["prompt"]
    raise InvalidRequestError(
        f"a prompt dict holds 'prompt' (text) or 'prompt_token_ids' (ids) alone; got keys "
        f"{sorted(item)}")


def _error_output(request_id: str, prompt: Prompt, exc: LoomError) -> RequestOutput:
    text = prompt if isinstance(prompt, str) else None
    ids = [] if isinstance(prompt, str) else list(prompt)
    return RequestOutput(
        request_id=request_id,
        prompt=text,
        prompt_token_ids=ids,
        outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="error")],
        finished=True,
        error=str(exc),
    )


def _as_embedding(out: EngineOutput) -> EmbeddingRequestOutput:
    """An embedding request's output; a failed one (an error output) with no embedding."""
    if isinstance(out, EmbeddingRequestOutput):
        return out
    return EmbeddingRequestOutput(request_id=out.request_id, outputs=EmbeddingOutput([]),
                                  prompt_token_ids=out.prompt_token_ids, prompt=out.prompt,
                                  error=out.error or "the request failed")
