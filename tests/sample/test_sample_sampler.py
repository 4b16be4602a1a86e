"""The batched `Sampler`: greedy, seeds, batch independence, statistics and logprobs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sample.reference import empirical, total_variation

from loom.sample import (
    Sampler,
    SamplingRow,
    filtered_probs,
    make_generator,
    sample_from_logits,
)
from loom.sample.draw import inverse_cdf, uniforms
from loom.sampling_params import SamplingParams

VOCAB = 50


def _logits(batch: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def _row(params: SamplingParams, prompt: list[int] | None = None) -> SamplingRow:
    gen = None if params.seed is None else make_generator(params.seed)
    return SamplingRow(params, list(prompt or [1, 2, 3]), [], gen, {0})


MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(seed=1),
    SamplingParams(seed=2, temperature=0.7, top_k=5),
    SamplingParams(seed=3, top_p=0.8),
    SamplingParams(seed=4, top_k=10, top_p=0.9, min_p=0.05),
    SamplingParams(seed=5, repetition_penalty=1.5, presence_penalty=0.5, min_tokens=2),
    SamplingParams(temperature=1.2),  # unseeded: global RNG
    SamplingParams(seed=6, temperature=0.0, frequency_penalty=1.0),
]


def _run(rows: list[SamplingRow], steps: int, seed: int) -> list[list[int]]:
    """Samples `steps` tokens for every row, feeding each token back as output."""
    sampler = Sampler()
    for step in range(steps):
        out = sampler(_logits(len(rows), seed + step), rows)
        for row, tok in zip(rows, out.token_ids, strict=True):
            row.output_token_ids.append(tok)
    return [row.output_token_ids for row in rows]


def test_greedy_is_argmax_and_deterministic() -> None:
    logits = _logits(6, 0)
    rows = [_row(SamplingParams(temperature=0.0)) for _ in range(6)]
    first = Sampler()(logits, rows).token_ids
    assert first == logits.argmax(-1).tolist()
    assert Sampler()(logits, rows).token_ids == first


def test_mixed_batch_equals_each_row_alone() -> None:
    batched = _run([_row(p) for p in MIXED], steps=6, seed=10)
    for i, params in enumerate(MIXED):
        if params.seed is None and params.temperature > 0:
            continue  # global RNG: depends on the batch by design
        row = _row(params)
        for step in range(6):
            logits = _logits(len(MIXED), 10 + step)[i : i + 1]
            row.output_token_ids.append(Sampler()(logits, [row]).token_ids[0])
        assert row.output_token_ids == batched[i], f"row {i} ({params})"


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(
        st.builds(
            SamplingParams,
            temperature=st.sampled_from([0.0, 0.5, 1.0]),
            top_k=st.sampled_from([-1, 3, 20]),
            top_p=st.sampled_from([1.0, 0.7]),
            min_p=st.sampled_from([0.0, 0.1]),
            repetition_penalty=st.sampled_from([1.0, 1.4]),
            seed=st.integers(0, 1000),
        ),
        min_size=1,
        max_size=5,
    ),
    seed=st.integers(0, 10_000),
)
def test_batch_composition_does_not_change_seeded_samples(
    specs: list[SamplingParams], seed: int
) -> None:
    batched = _run([_row(p) for p in specs], steps=3, seed=seed)
    # Row i alone, fed the same logits rows it saw in the batch.
    for i, params in enumerate(specs):
        row = _row(params)
        for step in range(3):
            logits = _logits(len(specs), seed + step)[i : i + 1]
            row.output_token_ids.append(Sampler()(logits, [row]).token_ids[0])
        assert row.output_token_ids == batched[i]


def test_same_seed_same_samples_different_seed_differs() -> None:
    def sequence(seed: int) -> list[int]:
        return _run([_row(SamplingParams(seed=seed, temperature=1.5))], 30, seed=0)[0]

    assert sequence(7) == sequence(7)
    assert sequence(7) != sequence(8)


def test_unseeded_rows_follow_global_rng() -> None:
    logits = _logits(4, 3)
    rows = [_row(SamplingParams(temperature=2.0)) for _ in range(4)]
    torch.manual_seed(123)
    first = Sampler()(logits, rows).token_ids
    torch.manual_seed(123)
    assert Sampler()(logits, rows).token_ids == first


STAT_PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.6, top_k=6),
    SamplingParams(top_p=0.85, min_p=0.02),
    SamplingParams(temperature=1.3, top_k=8, top_p=0.9, repetition_penalty=1.3),
]


@pytest.mark.parametrize("params", STAT_PARAMS, ids=range(len(STAT_PARAMS)))
def test_sample_frequencies_match_filtered_probs(params: SamplingParams) -> None:
    vocab, draws = 12, 20_000
    logits = _logits(1, 99, vocab)[0]
    prompt = [0, 3]
    probs = filtered_probs(logits, params, prompt_token_ids=prompt).tolist()
    # Batched path: many identical unseeded rows in one call.
    torch.manual_seed(0)
    rows = [_row(params, prompt) for _ in range(draws)]
    batch = Sampler()(logits.expand(draws, vocab), rows).token_ids
    # Resample path: n draws from one stored row with one generator.
    drawn = sample_from_logits(logits, params, draws, make_generator(0), prompt_token_ids=prompt)
    for tokens in (batch, [t for t, _ in drawn]):
        freq = empirical(tokens, vocab)
        assert all(f == 0.0 for f, p in zip(freq, probs, strict=True) if p == 0.0)
        assert total_variation(freq, probs) < 0.02  # expected ~0.006 for 20k draws


def test_seeded_row_frequencies_over_steps_match_filtered_probs() -> None:
    vocab, steps = 8, 4_000
    logits = _logits(1, 5, vocab)
    params = SamplingParams(seed=11, temperature=0.8, top_p=0.95)
    row = _row(params)
    sampler = Sampler()
    tokens = [sampler(logits, [row]).token_ids[0] for _ in range(steps)]
    probs = filtered_probs(logits[0], params).tolist()
    assert total_variation(empirical(tokens, vocab), probs) < 0.03


def test_logprobs_are_raw_log_softmax() -> None:
    logits = _logits(3, 8)
    rows = [
        _row(SamplingParams(temperature=0.5, repetition_penalty=2.0, logprobs=3, seed=1)),
        _row(SamplingParams(temperature=0.0, logprobs=0)),
        _row(SamplingParams(top_k=2, seed=2)),
    ]
    out = Sampler()(logits, rows)
    raw = logits.log_softmax(-1)
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, tok].item(), abs=1e-5)
    values, ids = raw[0].topk(3)
    assert [t for t, _ in out.top_logprobs[0]] == ids.tolist()
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx(values.tolist(), abs=1e-5)
    assert out.top_logprobs[1] == []
    assert out.top_logprobs[2] is None


def test_top_logprobs_per_row_counts_and_clamp_to_vocab() -> None:
    logits = _logits(2, 4, vocab=5)
    rows = [_row(SamplingParams(logprobs=2)), _row(SamplingParams(logprobs=20))]
    out = Sampler()(logits, rows)
    assert len(out.top_logprobs[0]) == 2
    assert len(out.top_logprobs[1]) == 5
    assert sum(torch.tensor([lp for _, lp in out.top_logprobs[1]]).exp()) == pytest.approx(1.0)


def test_bfloat16_logits_accepted() -> None:
    logits = _logits(2, 1).bfloat16()
    rows = [_row(SamplingParams(temperature=0.0)), _row(SamplingParams(seed=3))]
    out = Sampler()(logits, rows)
    assert out.token_ids[0] == logits[0].float().argmax().item()


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="2 rows"):
        Sampler()(_logits(3, 0), [_row(SamplingParams()), _row(SamplingParams())])


# ---------------------------------------------------------------- sample_from_logits


def test_sample_from_logits_greedy_repeats_argmax() -> None:
    logits = _logits(1, 2)[0]
    got = sample_from_logits(logits, SamplingParams(temperature=0.0), 4)
    best = int(logits.argmax())
    assert [t for t, _ in got] == [best] * 4
    assert got[0][1] == pytest.approx(logits.log_softmax(-1)[best].item(), abs=1e-5)


@pytest.mark.parametrize("n", [1, 3])
def test_sample_from_logits_first_draw_matches_sampler(n: int) -> None:
    logits = _logits(1, 6)
    params = SamplingParams(seed=42, temperature=0.9, top_k=20)
    expected = Sampler()(logits, [_row(params)]).token_ids[0]
    got = sample_from_logits(logits[0], params, n, make_generator(42))
    assert got[0][0] == expected
    assert len(got) == n


def test_sample_from_logits_rejects_bad_n() -> None:
    with pytest.raises(ValueError, match="n >= 1"):
        sample_from_logits(_logits(1, 0)[0], SamplingParams(), 0)


def test_inverse_cdf_edges_never_pick_zero_probability_tokens() -> None:
    # 1000 entries: two blocks of 512, the second zero-padded; zeros at both ends.
    probs = torch.zeros(1, 1000)
    probs[0, 3] = 0.25
    probs[0, 600] = 0.5
    probs[0, 997] = 0.25
    u = torch.tensor([[0.0, 1.0 - 2**-53, 0.5, 0.3, 0.8]], dtype=torch.float64)
    # x = (1 - u) * total: u=0 -> last positive entry, u->1 -> first positive entry.
    assert inverse_cdf(probs, u).tolist() == [[997, 3, 600, 600, 3]]


def test_inverse_cdf_frequencies_with_padding() -> None:
    vocab, draws = 700, 40_000
    probs = torch.rand(1, vocab, generator=torch.Generator().manual_seed(1)) ** 4
    u = uniforms([make_generator(5)], draws, torch.device("cpu"))
    tokens = inverse_cdf(probs, u)[0].tolist()
    want = (probs[0] / probs.sum()).tolist()
    assert total_variation(empirical(tokens, vocab), want) < 0.055  # expected ~0.039 here


def test_logit_bias_is_added_to_its_rows_only_and_logprobs_stay_raw() -> None:
    logits = _logits(3, seed=9)
    plain = Sampler()(logits, [_row(SamplingParams(temperature=0.0))] * 3)
    banned = plain.token_ids[0]
    rows = [
        _row(SamplingParams(temperature=0.0, logit_bias={banned: -100})),  # bans the argmax
        _row(SamplingParams(temperature=0.0, logit_bias={7: 100.0})),  # forces token 7
        _row(SamplingParams(temperature=0.0)),
    ]
    out = Sampler()(logits, rows)
    assert out.token_ids[0] != banned
    assert out.token_ids[0] == int(logits[0].clone().index_fill_(0, torch.tensor([banned]),
                                                                  -1e9).argmax())
    assert out.token_ids[1] == 7
    assert out.token_ids[2] == plain.token_ids[2]
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs[1] == pytest.approx(float(raw[1, 7]), abs=1e-5)


@pytest.mark.parametrize("bias", [{-1: 1.0}, {3: 101}, {3: "x"}, [3], {True: 1.0}])
def test_bad_logit_bias_is_named(bias) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)
