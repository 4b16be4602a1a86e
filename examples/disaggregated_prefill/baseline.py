"""The reference: one process, no connector, prefill and decode together."""

from __future__ import annotations

from disagg_settings import MAX_TOKENS, make_llm, prompts, write_outputs

from loom import SamplingParams


def main() -> None:
    llm = make_llm()
    outputs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                           use_tqdm=False)
    write_outputs(outputs, "baseline_output.txt")


if __name__ == "__main__":
    main()
