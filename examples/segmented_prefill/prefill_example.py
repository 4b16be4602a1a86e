"""Stage 1 (producer): compute the prompts once and save their KV blocks to local_storage/.

Writes prefill_output.txt: one JSON string per line, each prompt followed by its first
generated token (the decode stages continue from there, loading the saved blocks).

Environment: LOOM_MODEL (default "gemma3-270m"), LOOM_EXAMPLE_WORDS (how many filler words
make up a prompt's context; default 96), LOOM_BLOCK_SIZE (default 16).
"""

from __future__ import annotations

import json
import os

from loom import LLM, SamplingParams
from loom.kv_connector import KVTransferConfig

MODEL = os.environ.get("LOOM_MODEL", "gemma3-270m")
WORDS = int(os.environ.get("LOOM_EXAMPLE_WORDS", "96"))
BLOCK_SIZE = int(os.environ.get("LOOM_BLOCK_SIZE", "16"))


def make_prompts() -> list[str]:
    """Long prompts made of repeated words: two pairs, the second of each pair starting with
    the context of the first (so they also share stored blocks)."""
    hello = "Hello " * WORDS
    okay = "okay " * (WORDS // 2)
    return [
        hello + "My favourite colour is",
        hello + hello + "The largest planet of the solar system is",
        okay + "The opposite of hot is",
        okay + okay + "Water freezes at a temperature of",
    ]


def main() -> None:
    llm = LLM(
        model=MODEL,
        dtype="float32",  # the decode stages compare texts: keep the arithmetic exact enough
        block_size=BLOCK_SIZE,
        num_kv_blocks=512,  # a small KV pool is plenty for these prompts
        kv_transfer_config=KVTransferConfig(
            kv_connector="SharedStorageConnector",
            kv_role="kv_producer",  # only saves
            kv_connector_extra_config={"shared_storage_path": "local_storage"},
        ),
    )
    prompts = make_prompts()
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)

    with open("prefill_output.txt", "w", encoding="utf-8") as f:
        for output in outputs:
            first_token = output.outputs[0].text
            print(f"prompt of {len(output.prompt_token_ids)} tokens "
                  f"...{output.prompt[-40:]!r} -> {first_token!r}")
            f.write(json.dumps(output.prompt + first_token) + "\n")
    print(f"saved {llm.engine.stats.kv_saved_blocks} KV blocks to local_storage/; "
          f"wrote {len(outputs)} prompts to prefill_output.txt")


if __name__ == "__main__":
    main()
