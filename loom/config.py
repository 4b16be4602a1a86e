"""vLLM's `vllm.config` names, so that `from loom.config import SpecialKwargs` runs as the
seeds' `from vllm.config import SpecialKwargs` does: the configuration classes users build.

Nothing in Loom imports this module (it only gathers names), so it adds no import cycle.
"""

from __future__ import annotations

from loom.engine.config import EngineArgs
from loom.engine.promise_sync import SpecialKwargs
from loom.sampling_params import SamplingParams

__all__ = ["EngineArgs", "SamplingParams", "SpecialKwargs"]
