"""Loom: an LLM inference engine whose requests are live sessions."""

from loom.errors import LoomError
from loom.pooling_params import PoolingParams
from loom.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "LLMEngine",
    "LoomError",
    "PoolingParams",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "SpecialKwargs",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from loom.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from loom.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncLLMEngine":
        from loom.engine.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    if name == "EngineArgs":
        from loom.engine.config import EngineArgs

        return EngineArgs
    if name == "SpecialKwargs":
        from loom.engine.promise_sync import SpecialKwargs

        return SpecialKwargs
    if name == "EmbeddingRequestOutput":
        from loom.engine.pooling import EmbeddingRequestOutput

        return EmbeddingRequestOutput
    if name in ("RequestOutput", "CompletionOutput"):
        from loom.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'loom' has no attribute {name!r}")
