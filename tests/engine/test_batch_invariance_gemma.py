"""Batch invariance on the real Gemma 3 270M in the true default mode (what
`LLM(model="gemma3-270m")` builds here): six prompts of 30-530 tokens give exactly the same
greedy tokens and logprobs as each prompt alone in a fresh engine with one fresh prefill,
whether they run in one batch cold, again from the prefix cache, one at a time, in chunks
of 48 tokens, or as sessions fed in three fragments (DESIGN.md section 5); and in random
mixes of those with preemption and n-gram drafts (hypothesis)."""

from __future__ import annotations

import pytest
from engine.helpers import run_to_completion
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loom import SamplingParams
from loom.engine.config import EngineArgs
from loom.engine.llm_engine import LLMEngine
from loom.tokenizer import load_tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
LENGTHS = (30, 75, 140, 260, 400, 530)
ALONE_BUDGET = 1024  # every prompt in one prefill chunk


def _passage(n: int) -> str:
    """Plain varied English text, long enough for `n` sentences."""
    ships = ["the Marigold", "a grey trawler", "the ferry from Oban", "two yachts",
             "a tanker", "the lifeboat", "a fishing fleet"]
    weather = ["calm", "rough", "foggy", "clear", "squally", "still"]
    return " ".join(
        f"Night {i}: the sea was {weather[i % len(weather)]}, {ships[i % len(ships)]} passed "
        f"at {(i * 37) % 24:02d}:{(i * 13) % 60:02d}, and the keeper noted {i * 3 + 1} gulls."
        for i in range(n)
    )


@pytest.fixture(scope="module")
def prompts(gemma_path) -> list[list[int]]:
    ids = load_tokenizer(gemma_path).encode(_passage(40), add_special_tokens=True)
    assert len(ids) >= max(LENGTHS)
    # Different starts, so the prompts share only their first (BOS) token.
    return [ids[:1] + ids[1 + 7 * k : length + 7 * k] for k, length in enumerate(LENGTHS)]


def default_engine(gemma_path, **kwargs) -> LLMEngine:
    """The engine `LLM(model="gemma3-270m")` builds (every mode argument "auto"), with a
    smaller pool and the given overrides."""
    return LLMEngine.from_engine_args(EngineArgs(model=str(gemma_path), num_kv_blocks=512,
                                                 **kwargs))


@pytest.fixture(scope="module")
def alone(gemma_path, prompts) -> list[tuple[list[int], list[dict]]]:
    """Each prompt alone in a fresh engine, one prefill: (tokens, logprobs)."""
    engine = default_engine(gemma_path, enable_prefix_caching=False,
                            max_num_batched_tokens=ALONE_BUDGET)
    refs = []
    for i, ids in enumerate(prompts):
        engine.add_request(f"alone-{i}", ids, GREEDY)
        out = run_to_completion(engine)[f"alone-{i}"].outputs[0]
        refs.append((list(out.token_ids), list(out.logprobs)))
    return refs


def generate(engine, prompts, tag):
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, GREEDY)
    outs = run_to_completion(engine)
    return [(list(o.token_ids), list(o.logprobs))
            for o in (outs[f"{tag}-{i}"].outputs[0] for i in range(len(prompts)))]


def differences(got, alone, prompts) -> list[str]:
    """One line per prompt whose tokens or logprobs differ from its alone run."""
    lines = []
    for i, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(
            zip(got, alone, strict=True)):
        if (tokens, logprobs) == (ref_tokens, ref_logprobs):
            continue
        first = next((p for p, (a, b) in enumerate(zip(logprobs, ref_logprobs, strict=False))
                      if a != b), None)
        same = next((p for p, (a, b) in enumerate(zip(tokens, ref_tokens, strict=False))
                     if a != b), len(tokens))
        diff = max((abs(a[t] - b[t]) for a, b in zip(logprobs[:same], ref_logprobs[:same],
                    strict=False) for t in a.keys() & b.keys()), default=0.0)
        lines.append(
            f"prompt {i} ({len(prompts[i])} tokens): "
            + (f"token {same} is {tokens[same]}, alone {ref_tokens[same]}; "
               if same < len(tokens) else "tokens equal; ")
            + f"logprobs first differ at generated position {first}, max |diff| {diff:.3g}")
    return lines


def _sessions_in_three_fragments(engine, prompts):
    """Every prompt as a session: the three thirds appended one after another (each
    computed and paused before the next), then a greedy segment from the stored logits."""
    cuts = [(0, len(ids) // 3, 2 * len(ids) // 3, len(ids)) for ids in prompts]
    for i, ids in enumerate(prompts):
        engine.add_request(f"s-{i}", ids[: cuts[i][1]], session=True)
    run_to_completion(engine)
    for k in (1, 2):
        for i, ids in enumerate(prompts):
            engine.append(f"s-{i}", ids[cuts[i][k] : cuts[i][k + 1]])
        run_to_completion(engine)
    for i in range(len(prompts)):
        engine.resume(f"s-{i}", GREEDY)
    outs = run_to_completion(engine)
    got = []
    for i, ids in enumerate(prompts):
        out = outs[f"s-{i}"].outputs[0]
        # The output holds the appended fragments, then the generated tokens.
        got.append((list(out.token_ids)[len(ids) - cuts[i][1]:], list(out.logprobs)))
        engine.close(f"s-{i}")
    return got


def test_gemma_default_mode_outputs_do_not_depend_on_the_batch(gemma_path, prompts, alone):
    engine = default_engine(gemma_path)
    chunked = default_engine(gemma_path, max_num_batched_tokens=48)
    problems: dict[str, list[str]] = {}

    def check(scenario, got):
        lines = differences(got, alone, prompts)
        if lines:
            problems[scenario] = lines

    check("one batch, cold", generate(engine, prompts, "cold"))
    hits = engine.stats.prefix_cache_hits
    check("the same batch again (prefix-cache hits)", generate(engine, prompts, "again"))
    assert engine.stats.prefix_cache_hits > hits
    check("one at a time (prefix-cache hits)",
          [generate(engine, [ids], f"single-{i}")[0] for i, ids in enumerate(prompts)])
    check("one batch, max_num_batched_tokens=48", generate(chunked, prompts, "chunked"))
    engine.reset_prefix_cache()
    check("sessions fed in three fragments", _sessions_in_three_fragments(engine, prompts))
    assert engine.kv_pool_all_free and chunked.kv_pool_all_free
    assert not problems, (
        f"mode {engine.config.mode_summary!r}: outputs differ from each prompt alone, fresh, "
        f"in {len(problems)} of 5 scenarios\n"
        + "\n".join(f"{name}:\n  " + "\n  ".join(lines) for name, lines in problems.items()))


@st.composite
def gemma_scenarios(draw):
    """A random mix on the default model: which prompts, the chunk budget, the prefix cache,
    a pool small enough to preempt, n-gram drafts, and which prompts arrive as sessions fed
    in fragments cut at random points."""
    chosen = draw(st.lists(st.integers(0, len(LENGTHS) - 1), min_size=2, max_size=4,
                           unique=True))
    sessions = {i: sorted(draw(st.lists(st.integers(1, LENGTHS[i] - 1), max_size=2,
                                        unique=True)))
                for i in chosen if draw(st.booleans())}
    return {
        "prompts": chosen,
        "sessions": sessions,
        "budget": draw(st.sampled_from([16, 48, 100, 512])),
        "prefix_cache": draw(st.booleans()),
        "blocks": draw(st.sampled_from([512, 80])),  # 80 blocks of 16: preemption
        "drafts": draw(st.sampled_from([0, 3])),
    }


@settings(max_examples=4, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(scenario=gemma_scenarios())
def test_gemma_random_mixes_equal_each_prompt_alone(gemma_path, prompts, alone, scenario):
    speculative = ({"method": "ngram", "num_speculative_tokens": scenario["drafts"]}
                   if scenario["drafts"] else None)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(gemma_path), num_kv_blocks=scenario["blocks"],
        max_num_batched_tokens=scenario["budget"],
        enable_prefix_caching=scenario["prefix_cache"], speculative_config=speculative))
    cuts = {i: [0, *points, len(prompts[i])] for i, points in scenario["sessions"].items()}
    for i in scenario["prompts"]:
        if i in cuts:
            engine.add_request(f"r-{i}", prompts[i][: cuts[i][1]], session=True)
        else:
            engine.add_request(f"r-{i}", prompts[i], GREEDY)
    outs = run_to_completion(engine)
    for k in range(1, max((len(c) - 1 for c in cuts.values()), default=1)):
        for i, c in cuts.items():
            if k + 1 < len(c):
                engine.append(f"r-{i}", prompts[i][c[k] : c[k + 1]])
        run_to_completion(engine)
    for i in cuts:
        engine.resume(f"r-{i}", GREEDY)
    outs.update(run_to_completion(engine))
    got, want, used = [], [], []
    for i in scenario["prompts"]:
        out = outs[f"r-{i}"].outputs[0]
        skip = len(prompts[i]) - cuts[i][1] if i in cuts else 0  # appended fragments
        got.append((list(out.token_ids)[skip:], list(out.logprobs)))
        want.append(alone[i])
        used.append(prompts[i])
        if i in cuts:
            engine.close(f"r-{i}")
    lines = differences(got, want, used)
    assert engine.kv_pool_all_free
    assert not lines, f"{scenario}: " + "; ".join(lines)
