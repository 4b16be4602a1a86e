"""The routing decision without Ray: pins are hard, a gone holder moves to the least loaded
replica, a new request follows the longest remembered prefix unless its replica is loaded
past the threshold, and otherwise goes to the least loaded replica."""

from __future__ import annotations

import random

import pytest

from loom.distributed.routing import (
    EXPLICIT,
    LEAST_LOADED,
    MOVED,
    PINNED,
    PREFIX,
    Route,
    RoutingPolicy,
    prefix_hashes,
)

BLOCK = 4


def policy(threshold: int = 8, memory: int = 4096) -> RoutingPolicy:
    return RoutingPolicy(threshold, memory, rng=random.Random(0))


def hashes(tokens: list[int]) -> tuple[bytes, ...]:
    return prefix_hashes(tokens, BLOCK)


def test_a_pinned_call_goes_to_its_holder_whatever_the_load():
    p = policy()
    decision = p.choose(Route(request="s", holder="b"), {"a": 0, "b": 100})
    assert (decision.replica, decision.reason) == ("b", PINNED)


def test_a_gone_holder_moves_to_the_least_loaded_other_replica():
    p = policy()
    decision = p.choose(Route(request="s", holder="dead"), {"a": 5, "b": 2, "c": 9})
    assert (decision.replica, decision.reason) == ("b", MOVED)


def test_an_avoided_replica_is_not_chosen_while_another_runs():
    p = policy()
    decision = p.choose(Route(request="s", holder="a", avoid=("a",)), {"a": 0, "b": 3})
    assert (decision.replica, decision.reason) == ("b", MOVED)
    assert p.choose(Route(avoid=("a",)), {"a": 0, "b": 3}).replica == "b"
    # The only replica left is used even when avoided.
    assert p.choose(Route(avoid=("a",)), {"a": 0}).replica == "a"


def test_an_explicit_target_goes_there_or_to_a_replica_that_refuses_it():
    p = policy()
    assert p.choose(Route(replica="b"), {"a": 0, "b": 9}) == p.choose(
        Route(replica="b"), {"a": 0, "b": 9})
    decision = p.choose(Route(replica="b"), {"a": 0, "b": 9})
    assert (decision.replica, decision.reason) == ("b", EXPLICIT)
    assert p.choose(Route(replica="gone"), {"a": 0}).replica == "a"


def test_no_running_replica_gives_no_decision():
    assert policy().choose(Route(), {}) is None


def test_a_new_request_follows_the_longest_prefix_match():
    p = policy()
    shared = list(range(100, 112))  # three full blocks
    p.remember("a", hashes(shared[:4]))
    p.remember("b", hashes(shared))
    decision = p.choose(Route(prefix=hashes(shared + [1, 2, 3, 4])), {"a": 0, "b": 3})
    assert (decision.replica, decision.reason, decision.matched) == ("b", PREFIX, 3)


def test_a_prefix_match_loses_to_the_least_loaded_past_the_threshold():
    p = policy(threshold=8)
    prompt = hashes(list(range(16)))
    p.remember("a", prompt)
    assert p.choose(Route(prefix=prompt), {"a": 8, "b": 0}).reason == PREFIX
    p2 = policy(threshold=8)
    p2.remember("a", prompt)
    decision = p2.choose(Route(prefix=prompt), {"a": 9, "b": 0})
    assert (decision.replica, decision.reason) == ("b", LEAST_LOADED)


def test_new_requests_without_a_match_spread_by_load_and_count_until_stats_refresh():
    p = policy()
    loads = {"a": 0, "b": 0}
    first = p.choose(Route(), loads).replica
    second = p.choose(Route(), loads).replica
    assert {first, second} == {"a", "b"}  # the first one's request counts against it
    p.stats_refreshed("a")
    p.stats_refreshed("b")
    assert p.choose(Route(), {"a": 4, "b": 1}).replica == "b"


def test_a_routed_prompt_is_remembered_and_a_different_one_is_not_matched():
    p = policy()
    prompt = hashes(list(range(12)))
    chosen = p.choose(Route(prefix=prompt), {"a": 0, "b": 0}).replica
    again = p.choose(Route(prefix=prompt), {"a": 0, "b": 0})
    assert (again.replica, again.reason, again.matched) == (chosen, PREFIX, 3)
    other = hashes(list(range(50, 62)))
    assert p.matched_blocks(chosen, other) == 0


def test_prefix_memory_is_bounded_and_forgets_the_oldest():
    p = policy(memory=4)
    old, new = hashes(list(range(16))), hashes(list(range(200, 216)))
    p.remember("a", old)
    p.remember("a", new)
    assert p.matched_blocks("a", new) == 4
    assert p.matched_blocks("a", old) == 0
    p.forget("a")
    assert p.matched_blocks("a", new) == 0


def test_prefix_hashes_cover_full_blocks_only_and_chain():
    assert hashes([1, 2, 3]) == ()
    a, b = hashes([1, 2, 3, 4, 5, 6, 7, 8, 9]), hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and a[1] != b[1]  # block 1 has the same tokens, another parent


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        RoutingPolicy(-1)
    with pytest.raises(ValueError):
        RoutingPolicy(8, 0)
