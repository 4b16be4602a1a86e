"""What the three processes of this example share: the model, the prompts, the KV store."""

from __future__ import annotations

import os
from typing import Any

from loom import LLM
from loom.kv_connector import KVTransferConfig

MODEL = os.environ.get("LOOM_MODEL", "gemma3-270m")
BLOCK_SIZE = int(os.environ.get("LOOM_BLOCK_SIZE", "16"))  # producer and consumer must agree
WORDS = int(os.environ.get("LOOM_EXAMPLE_WORDS", "64"))  # filler words per prompt
STORE = "kv_store"  # the folder the producer writes and the consumer reads
MAX_TOKENS = 12  # tokens the consumer (and the baseline) generate


def prompts() -> list[str]:
    """Long prompts that share no leading block (each starts differently)."""
    return [
        "Notes on the weather. " + "Rain " * WORDS + "Tomorrow the sky will be",
        "A list of fruit: " + "apple, " * WORDS + "and finally a",
        "Counting sheep at night: " + "sheep " * WORDS + "The farmer's name was",
    ]


def kv_config(role: str) -> KVTransferConfig:
    """The shared-folder connector in the given role ("kv_producer" or "kv_consumer")."""
    return KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_role=role,
        kv_connector_extra_config={"shared_storage_path": STORE},
    )


def make_llm(**kwargs: Any) -> LLM:
    """The same engine settings in every process (only the connector differs)."""
    return LLM(model=MODEL, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=512, **kwargs)


def write_outputs(outputs: list[Any], path: str) -> None:
    """One prompt and its generated text per entry, in a form `diff` compares well."""
    with open(path, "w", encoding="utf-8") as f:
        for output in outputs:
            f.write(f"Prompt: {output.prompt!r}\nGenerated text: {output.outputs[0].text!r}\n")
    for output in outputs:
        print(f"...{output.prompt[-30:]!r} -> {output.outputs[0].text!r}")
    print(f"wrote {path}")
