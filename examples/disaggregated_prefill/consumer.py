"""The decode instance: loads the prompts' KV from the shared folder, computes only what the
store cannot hold (the last prompt token, whose logits start the generation) and generates.

Exits 1 unless every full block before each prompt's last token came from the store."""

from __future__ import annotations

import sys

from disagg_settings import BLOCK_SIZE, MAX_TOKENS, kv_config, make_llm, prompts, write_outputs

from loom import SamplingParams


def main() -> None:
    llm = make_llm(kv_transfer_config=kv_config("kv_consumer"))  # loads, never saves
    outputs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                           use_tqdm=False)
    write_outputs(outputs, "consumer_output.txt")

    # The store holds each prompt's full blocks; the last token is always computed here.
    expected = sum((len(o.prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE for o in outputs)
    stats = llm.engine.stats
    print(f"consumer: kv_loaded_tokens={stats.kv_loaded_tokens} (expected {expected}) "
          f"kv_gap_tokens={stats.kv_gap_tokens} kv_load_failed_tokens="
          f"{stats.kv_load_failed_tokens} prefix_cache_hits={stats.prefix_cache_hits}")
    if stats.kv_loaded_tokens != expected or stats.prefix_cache_hits or stats.kv_gap_tokens:
        sys.exit("FAILED: the consumer computed prompt tokens the store holds")
    print("consumer: every stored prompt block was loaded, none computed")


if __name__ == "__main__":
    main()
