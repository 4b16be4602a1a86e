"""OpenAI's harmony chat format (gpt-oss's): conversations rendered to token ids and outputs
parsed by channel, by the openai-harmony package where it can serve the model's vocabulary
and by Loom's own renderer and parser elsewhere (`codec.py`)."""

from __future__ import annotations

from loom.harmony.codec import LOOM_BACKEND, PACKAGE_BACKEND, HarmonyCodec
from loom.harmony.conversation import (
    HarmonyMessage,
    HarmonyTool,
    SystemOptions,
    drop_stale_analysis,
    from_openai,
)
from loom.harmony.events import ContentDelta, HarmonyEvent, Header, MessageDone
from loom.harmony.parser import HarmonyParser

__all__ = [
    "LOOM_BACKEND",
    "PACKAGE_BACKEND",
    "ContentDelta",
    "HarmonyCodec",
    "HarmonyEvent",
    "HarmonyMessage",
    "HarmonyParser",
    "HarmonyTool",
    "Header",
    "MessageDone",
    "SystemOptions",
    "drop_stale_analysis",
    "from_openai",
]
