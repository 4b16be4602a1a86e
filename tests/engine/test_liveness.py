"""Liveness: a run ends within a number of steps bounded by its work, even when pinned
sessions hold most of the KV pool (a request that can never fit fails with a clear error)."""

from __future__ import annotations

from engine.helpers import liveness_bound, make_engine

from loom import SamplingParams

GREEDY5 = SamplingParams(temperature=0.0, max_tokens=5)


def sampled(max_tokens: int, ignore_eos: bool = False) -> SamplingParams:
    """Seeded temperature-1 sampling as the stateful session test draws it."""
    return SamplingParams(temperature=1.0, seed=5, max_tokens=max_tokens, ignore_eos=ignore_eos)


# (pinned, sampling params, prompt ids): the 20 sessions, in order, that livelocked the
# stateful test on a 28-block pool (found by hypothesis on a 16-core host).
PINNED_SESSIONS = [
    (False, None, [3, 3, 163, 47, 206]),
    (True, None, [261, 108, 92, 131, 5, 111]),
    (True, None, [154, 233, 408, 244, 121, 444]),
    (False, None, [3, 438, 264]),
    (False, None, [17, 381]),
    (True, None, [59, 338]),
    (True, None, [161, 131]),
    (False, None, [3, 106, 18, 138, 288]),
    (False, None, [3, 293, 243]),
    (False, None, [141, 338, 41, 500, 286, 97, 3, 97, 474, 103]),
    (True, None, [179, 19, 189, 163, 384, 457]),
    (False, None, [183, 217]),
    (True, sampled(3, ignore_eos=True), [360, 109, 150, 398, 372, 127, 171, 65, 435, 499, 356,
                                         334]),
    (True, None, [128, 496]),
    (True, None, [92, 287, 271, 255, 86, 358, 128, 57]),
    (True, None, [39]),
    (True, GREEDY5, [25]),
    (True, None, [443, 419, 194, 234, 193, 500, 187, 343, 169, 180, 153, 218]),
    (True, sampled(5), [386, 151, 91, 426, 74, 14, 450, 189, 30, 76, 64]),
    (False, sampled(3), [358, 6, 426, 149, 3, 296, 255, 349, 279, 147, 441, 13]),
]


def test_request_that_cannot_fit_beside_pinned_sessions_fails_instead_of_livelocking(
    tiny_models,
):
    folder, _ = tiny_models["qwen2"]
    engine = make_engine(folder, num_kv_blocks=28, block_size=4, max_num_batched_tokens=10,
                         max_model_len=96)
    for i, (pin, params, prompt) in enumerate(PINNED_SESSIONS):
        engine.add_request(f"s{i}", prompt, params, session=True, pin=pin)
    work = sum(len(prompt) + (p.max_tokens if p else 0) for _, p, prompt in PINNED_SESSIONS)
    bound = liveness_bound(work)
    errors = {}
    while engine.has_unfinished_requests():
        assert engine.num_steps <= bound, (
            f"{engine.num_steps} steps for {work} tokens of work: "
            f"{engine.scheduler.num_preemptions} preemptions, "
            f"{engine.num_recomputed_tokens} tokens recomputed"
        )
        for out in engine.step():
            if out.error is not None:
                errors[out.request_id] = out.error
    assert engine.num_recomputed_tokens <= work
    for rid, error in errors.items():
        assert "cannot be scheduled" in error and "pinned" in error, (rid, error)
    assert errors  # the pinned sessions leave too little room for at least one of them
    for rid in engine.table.group_ids():
        engine.close(rid)
    assert engine.kv_pool_all_free
