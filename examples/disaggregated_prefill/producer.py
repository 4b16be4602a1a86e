"""The prefill instance: computes every prompt once (one sampled token, then done) and saves
the prompts' full KV blocks to the shared folder."""

from __future__ import annotations

from disagg_settings import kv_config, make_llm, prompts

from loom import SamplingParams


def main() -> None:
    llm = make_llm(kv_transfer_config=kv_config("kv_producer"))  # saves, never loads
    llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    print(f"producer: saved {llm.engine.stats.kv_saved_blocks} KV blocks")


if __name__ == "__main__":
    main()
