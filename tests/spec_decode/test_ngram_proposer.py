"""N-gram (prompt lookup) drafting and the speculative configuration's validation."""

import pytest

from loom.errors import InvalidRequestError
from loom.spec_decode import NgramProposer, SpeculativeConfig


def proposer(lo=1, hi=4):
    return NgramProposer(SpeculativeConfig(prompt_lookup_min=lo, prompt_lookup_max=hi))


def test_proposes_what_followed_the_longest_latest_match():
    ids = [5, 1, 2, 3, 9, 9, 7, 2, 3, 8, 8, 1, 2, 3]
    # Suffix "1 2 3" occurred at 1..3 (followed by 9 9 7); "2 3" also at 7..8 (then 8 8).
    assert proposer().propose(ids, 3) == [9, 9, 7]
    assert proposer(hi=2).propose(ids, 3) == [8, 8, 1]  # only 2-grams: the latest wins


def test_follows_a_repeating_cycle_past_the_end():
    assert proposer().propose([4, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert proposer().propose([6, 6, 6], 4) == [6, 6, 6, 6]


def test_no_match_or_too_short_a_match_proposes_nothing():
    assert proposer().propose([1, 2, 3, 4], 4) == []
    assert proposer(lo=2).propose([1, 2, 9, 2], 4) == []  # only a 1-gram matches
    assert proposer(lo=2).propose([1, 2, 9, 1, 2], 4) == [9, 1, 2, 9]
    assert proposer().propose([7], 4) == []
    assert proposer().propose([1, 2, 1], 0) == []


def test_config_rejects_bad_values_with_clear_messages():
    with pytest.raises(InvalidRequestError, match="unknown speculative method 'eagle'"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens must be >= 1"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(InvalidRequestError, match="prompt_lookup_min <= prompt_lookup_max"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(InvalidRequestError, match=r"unknown speculative_config key\(s\) \['k'\]"):
        SpeculativeConfig.from_dict({"k": 3})
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert config.num_speculative_tokens == 2 and config.prompt_lookup_max == 4
