"""Penalties, min_tokens and logits processors: hand computations and the reference."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sample.reference import ref_penalties

from loom.sample import Sampler, SamplingRow, filtered_probs
from loom.sample.sampler import process_logits
from loom.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, -1.0, 0.5, -0.5, 1.0, 3.0])


def test_penalties_match_hand_computation() -> None:
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    row = SamplingRow(params, prompt_token_ids=[0, 1], output_token_ids=[1, 2, 2])
    got = process_logits(LOGITS.unsqueeze(0), [row])[0]
    # token 0: prompt only, positive -> 2/2;  token 1: negative, once in output ->
    # -1*2 - 0.25 - 0.5;  token 2: positive, twice in output -> 0.5/2 - 2*0.25 - 0.5
    want = torch.tensor([1.0, -2.75, -0.75, -0.5, 1.0, 3.0])
    torch.testing.assert_close(got, want)


def test_presence_and_frequency_ignore_prompt_tokens() -> None:
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)
    row = SamplingRow(params, prompt_token_ids=[0, 5], output_token_ids=[4])
    got = process_logits(LOGITS.unsqueeze(0), [row])[0]
    torch.testing.assert_close(got, torch.tensor([2.0, -1.0, 0.5, -0.5, -1.0, 3.0]))


def test_rows_without_penalties_untouched_in_mixed_batch() -> None:
    batch = torch.stack([LOGITS, LOGITS, LOGITS])
    rows = [
        SamplingRow(SamplingParams(), [0, 1], [2]),
        SamplingRow(SamplingParams(repetition_penalty=2.0), [0, 1], [2]),
        SamplingRow(SamplingParams(temperature=0.0), [5], [5]),
    ]
    before = batch.clone()
    got = process_logits(batch, rows)
    assert torch.equal(batch, before), "input modified"
    torch.testing.assert_close(got[0], LOGITS)
    torch.testing.assert_close(got[1], torch.tensor([1.0, -2.0, 0.25, -0.5, 1.0, 3.0]))
    torch.testing.assert_close(got[2], LOGITS)


def test_token_ids_beyond_vocab_are_ignored() -> None:
    row = SamplingRow(SamplingParams(repetition_penalty=2.0), [0, 100], [6, 1000])
    got = process_logits(LOGITS.unsqueeze(0), [row])[0]
    torch.testing.assert_close(got, torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, 3.0]))


@settings(max_examples=80, deadline=None)
@given(
    rep=st.sampled_from([1.0, 0.7, 1.3, 2.0]),
    pres=st.sampled_from([0.0, -0.5, 0.8]),
    freq=st.sampled_from([0.0, 0.3, -1.2]),
    prompt=st.lists(st.integers(0, 15), max_size=12),
    output=st.lists(st.integers(0, 15), max_size=12),
    seed=st.integers(0, 2**31 - 1),
)
def test_penalties_match_reference(
    rep: float, pres: float, freq: float, prompt: list[int], output: list[int], seed: int
) -> None:
    logits = torch.randn(16, generator=torch.Generator().manual_seed(seed)) * 3
    params = SamplingParams(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)
    got = process_logits(logits.unsqueeze(0), [SamplingRow(params, prompt, output)])[0]
    want = torch.tensor(ref_penalties(logits.tolist(), params, prompt, output))
    torch.testing.assert_close(got, want)


def test_greedy_sees_penalties() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    out = Sampler()(logits, [SamplingRow(params, [], [0])])
    assert out.token_ids == [1]


# ---------------------------------------------------------------- min_tokens

EOS = 7
MIN_LOGITS = torch.zeros(8)


def _support(params: SamplingParams, num_output: int) -> list[bool]:
    probs = filtered_probs(
        MIN_LOGITS, params, output_token_ids=[1] * num_output, eos_token_ids={EOS}
    )
    return (probs > 0).tolist()


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached() -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=[3])
    for n in (0, 1):
        support = _support(params, n)
        assert not support[3] and not support[EOS]
        assert sum(support) == 6
    assert all(_support(params, 2))


def test_ignore_eos_leaves_eos_but_still_suppresses_stop_ids() -> None:
    support = _support(SamplingParams(min_tokens=1, stop_token_ids=[3], ignore_eos=True), 0)
    assert support[EOS] and not support[3]


def test_min_tokens_greedy_picks_best_non_eos() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0]])
    row = SamplingRow(SamplingParams(temperature=0.0, min_tokens=1), eos_token_ids={3})
    assert Sampler()(logits, [row]).token_ids == [2]
    row.output_token_ids.append(2)
    assert Sampler()(logits, [row]).token_ids == [3]


# ---------------------------------------------------------------- logits processors


def test_logits_processor_two_and_three_arguments() -> None:
    seen: list[tuple[list[int], ...]] = []

    def ban_zero(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append((output_ids,))
        logits[0] = float("-inf")  # edits the view in place
        return logits

    def boost_last_prompt(
        prompt: list[int], output: list[int], logits: torch.Tensor
    ) -> torch.Tensor:
        seen.append((prompt, output))
        boosted = logits.clone()  # returns a new tensor
        boosted[prompt[-1]] += 100.0
        return boosted

    logits = torch.tensor([[9.0, 1.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.0, logits_processors=[ban_zero, boost_last_prompt])
    before = logits.clone()
    out = Sampler()(logits, [SamplingRow(params, [1, 2], [3])])
    assert out.token_ids == [2]
    assert seen == [([3],), ([1, 2], [3])]
    assert torch.equal(logits, before), "caller's logits modified"


def test_logits_processors_run_before_penalties() -> None:
    def add_ten(_output: list[int], logits: torch.Tensor) -> torch.Tensor:
        return logits + 10.0

    params = SamplingParams(repetition_penalty=2.0, logits_processors=[add_ten])
    row = SamplingRow(params, [], [1])
    got = process_logits(torch.tensor([[-4.0, -4.0]]), [row])[0]
    torch.testing.assert_close(got, torch.tensor([6.0, 3.0]))
