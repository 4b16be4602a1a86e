"""Each filter, alone and combined, against the one-row float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from sample.reference import ref_filtered_probs, ref_min_p, ref_top_k, ref_top_p

from loom.sample import filtered_probs
from loom.sample.filters import apply_min_p, apply_temperature, apply_top_k_top_p
from loom.sampling_params import SamplingParams

VOCAB = 64


def _logits(seed: int, vocab: int = VOCAB, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=gen) * scale


def _assert_same_distribution(got: torch.Tensor, want: list[float]) -> None:
    want_t = torch.tensor(want, dtype=torch.float64)
    assert torch.equal(got > 0, want_t > 0), "supports differ"
    torch.testing.assert_close(got.double(), want_t, atol=1e-5, rtol=1e-4)


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.sampled_from([-1, 0, 1, 2, 5, 17, VOCAB - 1, VOCAB, 1000]),
    top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.01, 0.05, 0.3]),
)


@settings(max_examples=150, deadline=None)
@given(params=params_strategy, seed=st.integers(0, 2**31 - 1))
def test_filtered_probs_matches_reference(params: SamplingParams, seed: int) -> None:
    logits = _logits(seed)
    want, margin = ref_filtered_probs(logits, params)
    assume(margin > 1e-4)  # float32 vs float64 may disagree at the exact top-p edge
    _assert_same_distribution(filtered_probs(logits, params), want)


@pytest.mark.parametrize("temperature", [0.25, 1.0, 3.0])
def test_temperature_only_scales(temperature: float) -> None:
    logits = _logits(1)
    got = filtered_probs(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(got, (logits / temperature).softmax(-1))


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_keeps_exactly_k(k: int) -> None:
    got = filtered_probs(_logits(2), SamplingParams(top_k=k))
    assert int((got > 0).sum()) == k


def test_top_k_keeps_ties_with_kth() -> None:
    logits = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0])
    got = filtered_probs(logits, SamplingParams(top_k=2))
    assert (got > 0).tolist() == [True, True, True, True, False]


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()

    def kept(p: float) -> int:
        return int((filtered_probs(logits, SamplingParams(top_p=p)) > 0).sum())

    assert kept(0.4) == 1
    assert kept(0.6) == 2
    assert kept(0.85) == 3
    assert kept(0.99) == 4


def test_a_top_p_that_float32_rounds_to_zero_keeps_the_top_token() -> None:
    # Found by the server's schemathesis run: top_p=3.7e-197 is 0 in float32.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    for top_k in (-1, 2):
        got = filtered_probs(logits, SamplingParams(top_p=3.7e-197, top_k=top_k))
        torch.testing.assert_close(got, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_top_p_applies_to_renormalised_top_k() -> None:
    # After top_k=2 the mass is [0.625, 0.375]; top_p=0.6 then keeps only the first.
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    got = filtered_probs(logits, SamplingParams(top_k=2, top_p=0.6))
    torch.testing.assert_close(got, torch.tensor([1.0, 0.0, 0.0]))


def test_min_p_relative_to_top_probability() -> None:
    logits = torch.tensor([0.5, 0.2, 0.04, 0.26]).log()
    got = filtered_probs(logits, SamplingParams(min_p=0.1))  # cut at 0.05
    assert (got > 0).tolist() == [True, True, False, True]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from([0, 1, 3, 10, VOCAB]),
            st.sampled_from([1.0, 0.9, 0.5]),
            st.sampled_from([0.0, 0.05]),
            st.sampled_from([0.5, 1.0, 2.0]),
        ),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_batched_filters_equal_per_row_reference(
    rows: list[tuple[int, float, float, float]], seed: int
) -> None:
    batch = torch.stack([_logits(seed + i) for i in range(len(rows))])
    ks, ps, min_ps, temps = (list(col) for col in zip(*rows, strict=True))
    got = apply_temperature(batch, temps)
    got = apply_min_p(got, min_ps)
    got = apply_top_k_top_p(got, ks, ps)
    for i, (k, p, min_p, temp) in enumerate(rows):
        want = [x / temp for x in batch[i].double().tolist()]
        want = ref_top_k(ref_min_p(want, min_p), k)
        want, margin = ref_top_p(want, p)
        assume(margin > 1e-4)
        want_t = torch.tensor(want, dtype=torch.float64)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want_t)), f"row {i} support"
        finite = ~torch.isinf(want_t)
        torch.testing.assert_close(got[i][finite].double(), want_t[finite], rtol=1e-5, atol=1e-5)


def test_filters_do_not_modify_input() -> None:
    batch = torch.stack([_logits(s) for s in range(3)])
    before = batch.clone()
    scaled = apply_temperature(batch, [0.5] * 3)
    apply_top_k_top_p(apply_min_p(scaled, [0.1] * 3), [5, 0, 3], [1.0, 0.5, 0.5])
    apply_top_k_top_p(batch, [5, 0, 3], [1.0, 0.5, 0.5])
    apply_min_p(batch, [0.1, 0.0, 0.2])
    assert torch.equal(batch, before)


def test_disabled_filters_return_input_unchanged() -> None:
    batch = torch.stack([_logits(s) for s in range(2)])
    assert apply_top_k_top_p(batch, [-1, VOCAB], [1.0, 1.0]) is batch
    assert apply_min_p(batch, [0.0, 0.0]) is batch
    assert apply_temperature(batch, [1.0, 1.0]) is batch


def test_greedy_filtered_probs_is_one_hot() -> None:
    logits = _logits(5)
    got = filtered_probs(logits, SamplingParams(temperature=0.0))
    assert got.sum().item() == 1.0
    assert got.argmax().item() == logits.argmax().item()
    assert not math.isnan(got.sum().item())


@pytest.mark.parametrize("p", [0.3, 0.9, 0.97])
def test_top_p_on_large_vocab_candidates_and_full_sort_agree_with_reference(p: float) -> None:
    # 8192 > 4 x 1024 candidates: peaked rows are decided by the candidates, flat rows
    # (mass spread over thousands of tokens) fall back to the full sort.
    vocab = 8192
    gen = torch.Generator().manual_seed(3)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32).log()
    peaked = -2.0 * ranks[torch.randperm(vocab, generator=gen)]
    flat = torch.randn(vocab, generator=gen) * 0.5
    batch = torch.stack([peaked, flat, peaked + torch.randn(vocab, generator=gen) * 0.3])
    got = apply_top_k_top_p(batch, [-1, -1, -1], [p, p, p])
    for i in range(3):
        want, margin = ref_top_p(batch[i].double().tolist(), p)
        assert margin > 1e-5
        want_t = torch.tensor(want, dtype=torch.float64)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want_t)), f"row {i}"
