"""`make demo`: a madlibs story told live on the default model, what a live session gives
that re-submitting the text does not, then the fork/join scene on the instruct model.

The story is one session. Fragments of the template are appended to it while it lives, and
the model fills each blank with a short generation segment; nothing already computed is
released or recomputed. Every append is timed against re-submitting the whole text as a
fresh request with the prefix cache emptied first (with the cache on, the default, a
re-submission reuses the story's full blocks and costs about what an append does). At the
last blank, the likeliest first words are read from the session's stored logits, which a
re-submission would have to compute again.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from loom.demo_fork import MODEL as FORK_JOIN_MODEL
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
    """Time to compute the same tokens from scratch as a new request (until its logits), the
    prefix cache emptied first so that nothing of the story is reused."""
    engine.reset_prefix_cache()
    start = time.perf_counter()
    engine.add_request(f"resubmit-{k}", token_ids, session=True)
    _settle(engine)
    elapsed = time.perf_counter() - start
    engine.close(f"resubmit-{k}")
    return elapsed


@dataclass
class LikeliestWords:
    """The likeliest tokens at a blank, read from a session's stored logits, and how long
    that took."""

    texts: list[str]
    seconds: float


def run_madlibs(engine: LLMEngine) -> tuple[list[AppendTiming], LikeliestWords]:
    """Tell the story; returns the timing of every live append and the likeliest words at
    the last blank."""
    timings: list[AppendTiming] = []
    words = LikeliestWords([], 0.0)
    engine.add_request("story", TEMPLATE[0], session=True)
    _settle(engine)
    print(_paint(PREAMBLE, "2") + TEMPLATE[0][len(PREAMBLE) :], end="", flush=True)
    for k, fragment in enumerate([*TEMPLATE[1:], None]):
        if fragment is None:  # the last blank: its likeliest words, from the stored logits
            start = time.perf_counter()
            top = engine.get_logits("story").topk(3).indices.tolist()
            words = LikeliestWords([engine.tokenizer.decode([t]) for t in top],
                                   time.perf_counter() - start)
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
    return timings, words


def print_table(timings: list[AppendTiming], words: LikeliestWords) -> None:
    """The cost of every live append next to re-submitting the whole text (prefix cache
    emptied), then the likeliest words read from the stored logits."""
    print(_paint("live: the append into the session; resubmit: the whole text as a new request, "
                 "the prefix cache\nemptied first (with it on, the default, a re-submission "
                 "costs about what an append does)\n", "2"))
    print(f"{'append':>6} {'tokens':>6} {'context':>7} {'live ms':>8} {'resubmit ms':>11} {'x':>6}")
    for i, t in enumerate(timings):
        ratio = t.resubmit_s / t.live_s if t.live_s else float("inf")
        print(
            f"{i:>6} {t.num_tokens:>6} {t.context:>7} {t.live_s * 1e3:>8.1f} "
            f"{t.resubmit_s * 1e3:>11.1f} {ratio:>6.1f}"
        )
    print(f"\nstored logits: the likeliest first words at the last blank, read in "
          f"{words.seconds * 1e3:.1f} ms\nwithout computing a token: "
          + " ".join(repr(t) for t in words.texts))


def _load(args: EngineArgs) -> LLMEngine:
    start = time.perf_counter()
    engine = LLMEngine.from_engine_args(args)
    print(f"loaded {args.model} ({engine.config.mode_summary}) "
          f"in {time.perf_counter() - start:.1f} s\n")
    return engine


def main() -> None:
    """Load the models and run the demo: the story on the default (base) model, the fork/join
    scene on the instruct model, which writes the expansions a chat asks for."""
    engine = _load(EngineArgs(model="gemma3-270m"))
    print(_paint("madlibs: cyan = appended fragments, green [..] = the model's fills\n", "2"))
    timings, words = run_madlibs(engine)
    print_table(timings, words)
    assert engine.kv_pool_all_free
    recomputed = engine.num_recomputed_tokens
    del engine
    print()
    instruct = _load(EngineArgs(model=FORK_JOIN_MODEL, special_kwargs=fork_join_kwargs()))
    print(_paint("fork/join: <promise> after each outline item spawns a child sharing the "
                 "parent's KV; <sync> merges\ntheir sentences into the parent\n", "2"))
    out, _ = run_fork_join(instruct)
    print_tree(out)
    assert instruct.kv_pool_all_free
    print(f"\nrecomputed tokens: {recomputed + instruct.num_recomputed_tokens}")


if __name__ == "__main__":
    main()
