"""`make demo`: a madlibs story told live on the default model, then what live appends save.

The story is one session. Fragments of the template are appended to it while it lives, and
the model fills each blank with a short generation segment; nothing already computed is
released or recomputed. Afterwards, every append is timed against re-submitting the whole
text as a fresh request.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from loom.demo_fork import fork_join_kwargs, print_tree, run_fork_join
from loom.engine.config import EngineArgs
from loom.engine.llm_engine import LLMEngine
from loom.sampling_params import SamplingParams

# A long opening, so that the appends below happen at a context of several hundred tokens,
# where re-submitting the whole text costs a real prefill and a live append does not.
PREAMBLE = (
    "The old storyteller settled by the fire, and the children gathered close. Outside, the "
    "wind pushed snow against the shutters and the lanterns swayed on their hooks. She told "
    "them first about the roads: how they wound between the hills, how travellers lost their "
    "way when the fog came down from the mountains, and how the ferrymen on the grey river "
    "charged one copper coin in summer and two in winter. She told them about the markets, "
    "where merchants sold salt, wool, dried fish and bright ribbons, and where every story "
    "worth hearing was first whispered between the stalls. She told them about the castle on "
    "the cliff, whose towers had stood for three hundred years, and about the library at its "
    "heart, where the shelves reached so high that the librarians used ladders on wheels. "
    "Then she lowered her voice, because the real story was about to begin.\n\n"
)
TEMPLATE = [
    PREAMBLE + "Once upon a time, in a kingdom called",
    ", there lived a",
    " who loved nothing more than",
    ". Every morning, the",
    " would walk to the market to buy",
    ". One day, a stranger arrived carrying a",
    ", and said: \"",
]
FILL = SamplingParams(temperature=0.7, top_k=40, seed=7, max_tokens=4, stop=["\n", ".", ","])


@dataclass
class AppendTiming:
    """One live append measured against re-submitting the same text."""

    num_tokens: int
    context: int
    live_s: float
    resubmit_s: float


def _paint(text: str, code: str) -> str:
    return f"\033[{code}m{text}\033[0m" if sys.stdout.isatty() else text


def _settle(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _resubmit_cost(engine: LLMEngine, token_ids: list[int], k: int) -> float:
    """Time to compute the same tokens from scratch as a new request (until its logits)."""
    start = time.perf_counter()
    engine.add_request(f"resubmit-{k}", token_ids, session=True)
    _settle(engine)
    elapsed = time.perf_counter() - start
    engine.close(f"resubmit-{k}")
    return elapsed


def run_madlibs(engine: LLMEngine) -> list[AppendTiming]:
    """Tell the story; returns the timing of every live append."""
    timings: list[AppendTiming] = []
    engine.add_request("story", TEMPLATE[0], session=True)
    _settle(engine)
    print(_paint(PREAMBLE, "2") + TEMPLATE[0][len(PREAMBLE) :], end="", flush=True)
    for k, fragment in enumerate([*TEMPLATE[1:], None]):
        before = engine.get_session("story")
        engine.resume("story", FILL)
        _settle(engine)
        after = engine.get_session("story")
        filled = engine.tokenizer.decode(list(after.token_ids[len(before.token_ids) :]))
        print(_paint(f"[{filled.strip() or '...'}]", "1;32"), end="", flush=True)
        if fragment is None:
            break
        context = len(after.token_ids)
        start = time.perf_counter()
        num = engine.append("story", fragment)
        _settle(engine)
        live = time.perf_counter() - start
        print(_paint(fragment, "36"), end="", flush=True)
        full = list(engine.get_session("story").token_ids)
        timings.append(AppendTiming(num, context, live, _resubmit_cost(engine, full, k)))
    print("\n")
    engine.close("story")
    return timings


def print_table(timings: list[AppendTiming]) -> None:
    """The cost of every live append next to re-submitting the whole text."""
    print(f"{'append':>6} {'tokens':>6} {'context':>7} {'live ms':>8} {'resubmit ms':>11} {'x':>6}")
    for i, t in enumerate(timings):
        ratio = t.resubmit_s / t.live_s if t.live_s else float("inf")
        print(
            f"{i:>6} {t.num_tokens:>6} {t.context:>7} {t.live_s * 1e3:>8.1f} "
            f"{t.resubmit_s * 1e3:>11.1f} {ratio:>6.1f}"
        )


def main() -> None:
    """Load the default model and run the demo."""
    start = time.perf_counter()
    engine = LLMEngine.from_engine_args(
        EngineArgs(model="gemma3-270m", special_kwargs=fork_join_kwargs())
    )
    print(f"loaded gemma3-270m ({engine.config.mode_summary}) "
          f"in {time.perf_counter() - start:.1f} s\n")
    print(_paint("madlibs: cyan = appended fragments, green [..] = the model's fills\n", "2"))
    timings = run_madlibs(engine)
    print_table(timings)
    print(_paint("\nfork/join: <promise> after each outline item spawns a child sharing the "
                 "parent's KV; <sync> merges their expansions\n", "2"))
    out, _ = run_fork_join(engine)
    print_tree(out)
    assert engine.kv_pool_all_free
    print(f"\nrecomputed tokens: {engine.num_recomputed_tokens}")


if __name__ == "__main__":
    main()
