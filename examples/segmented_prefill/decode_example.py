"""Stages 2 and 3 (consumers): continue the prompts of prefill_output.txt, greedily, with
their KV loaded from local_storage/.

    python decode_example.py                      # every matched block is loaded
    python decode_example.py --segmented-prefill  # gaps in every match are computed instead

Writes decode_output.txt or segmented_prefill_decode_output.txt (run.sh compares them) and
prints the engine's KV transfer counters. With --segmented-prefill it also checks that the
engine computed exactly the gap tokens the connector chose, and exits 1 if not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from loom import LLM, SamplingParams
from loom.kv_connector import KVTransferConfig

MODEL = os.environ.get("LOOM_MODEL", "gemma3-270m")
BLOCK_SIZE = int(os.environ.get("LOOM_BLOCK_SIZE", "16"))


def read_prompts() -> list[str]:
    """The prompts the prefill stage wrote, one JSON string per line."""
    try:
        with open("prefill_output.txt", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        sys.exit("prefill_output.txt not found: run prefill_example.py first")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segmented-prefill", action="store_true",
                        help="load through SegmentedPrefillExampleConnector (simulated gaps)")
    args = parser.parse_args()

    store = {"shared_storage_path": "local_storage"}
    if args.segmented_prefill:
        config = KVTransferConfig(
            kv_connector="SegmentedPrefillExampleConnector",
            kv_connector_module_path="segmented_prefill_example_connector",
            kv_role="kv_consumer",  # only loads: both decode stages see the same store
            kv_connector_extra_config=store,
        )
        out_file, label = "segmented_prefill_decode_output.txt", "segmented prefill"
    else:
        config = KVTransferConfig(
            kv_connector="SharedStorageConnector",
            kv_role="kv_consumer",
            kv_connector_extra_config=store,
        )
        out_file, label = "decode_output.txt", "full load"

    llm = LLM(model=MODEL, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=512,
              kv_transfer_config=config)
    outputs = llm.generate(read_prompts(), SamplingParams(temperature=0, max_tokens=10),
                           use_tqdm=False)

    with open(out_file, "w", encoding="utf-8") as f:
        for output in outputs:
            text = output.outputs[0].text
            print(f"...{output.prompt[-40:]!r} -> {text!r}")
            f.write(f"Prompt: {output.prompt!r}\nGenerated text: {text!r}\n" + "-" * 30 + "\n")
    print(f"wrote {out_file}")

    stats = llm.engine.stats
    print(f"kv stats ({label}): kv_loaded_tokens={stats.kv_loaded_tokens} "
          f"kv_gap_tokens={stats.kv_gap_tokens} "
          f"kv_load_failed_tokens={stats.kv_load_failed_tokens} "
          f"kv_saved_blocks={stats.kv_saved_blocks}")
    if stats.kv_loaded_tokens == 0:
        sys.exit(f"FAILED ({label}): nothing was loaded from local_storage/")
    if args.segmented_prefill:
        chosen = llm.engine.kv_connector.recorded_gaps
        expected = sum(end - start for gaps in chosen.values() for start, end in gaps)
        if expected == 0:
            sys.exit("FAILED (segmented prefill): no gaps were chosen (prompts too short?)")
        if stats.kv_gap_tokens != expected:
            sys.exit(f"FAILED (segmented prefill): the engine computed {stats.kv_gap_tokens} "
                     f"gap tokens, the connector chose {expected}")
        print(f"the engine computed all {expected} gap tokens of {len(chosen)} requests")


if __name__ == "__main__":
    main()
