"""`Sampler`: one token per row of a [B, V] logits batch, plus its logprobs.

Pipeline (vLLM V1 order), each step batched over the rows that need it:

    raw logits ──> logprobs, top logprobs (log-softmax of the raw logits)
        │
        ├─ per-request logits processors      (every row)
        ├─ logit_bias                         (rows with a bias, one scatter)
        ├─ min_tokens: mask stop ids and eos  (every row)
        ├─ repetition / presence / frequency  (rows with penalties)
        ├─ greedy rows: argmax                (no softmax)
        └─ random rows: temperature -> min-p -> top-k -> top-p -> softmax
                        -> inverse CDF with one uniform from the row's generator

A seeded row draws its uniform from its own generator (and its filters are row-wise), so
its samples do not depend on the other rows of the batch; unseeded rows share one draw
from the global RNG. See `loom.sample.draw` for why inverse CDF and not an exponential
race: it needs one random number per row instead of V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from loom.kernels import argmax_logsumexp, use_cpu_kernels
from loom.sample.draw import inverse_cdf, uniforms
from loom.sample.filters import (
    apply_min_p,
    apply_temperature,
    apply_top_k_top_p,
    log_normaliser,
)
from loom.sample.logprob import Logprob
from loom.sample.penalties import (
    apply_logit_bias,
    apply_logits_processors,
    apply_min_tokens,
    apply_penalties,
)
from loom.sample.rows import SamplingRow, is_greedy
from loom.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplerOutput:
    """Per row: the sampled token, its raw logprob, and the top-N raw logprobs if asked (a
    row that reports logprobs gets `Logprob`s with their ranks; the others plain floats)."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, Logprob]] | None]
    # Rows whose logits processor raised: row index -> the exception (their token is
    # meaningless; the engine fails those requests and keeps the others).
    row_errors: dict[int, Exception] = field(default_factory=dict)


def process_logits(
    logits: Tensor, rows: Sequence[SamplingRow], errors: dict[int, Exception] | None = None
) -> Tensor:
    """Logits processors, logit bias, min_tokens and penalties over [B, V] (float32; input
    not modified).
    `errors`: see `apply_logits_processors`."""
    out = logits.float()
    if any(row.params.logits_processors for row in rows):
        out = out.clone() if out is logits else out
        apply_logits_processors(out, rows, errors)
        for i in errors or ():  # a failed row keeps its logits as they came in
            out[i] = logits[i]
    out = apply_logit_bias(out, rows)
    out = apply_min_tokens(out, rows)
    return apply_penalties(out, rows)


def random_filter(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """Temperature, min-p, top-k and top-p over [R, V] logits of non-greedy rows."""
    params = [row.params for row in rows]
    logits = apply_temperature(logits, [p.temperature for p in params])
    logits = apply_min_p(logits, [p.min_p for p in params])
    return apply_top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])


def _sample_random(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """Samples one token per row of [R, V] processed logits through the random pipeline."""
    probs = random_filter(logits, rows).softmax(dim=-1)
    u = uniforms([r.generator for r in rows], 1, probs.device)
    return inverse_cdf(probs, u).squeeze(1)


def choose_tokens(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """[B] int64 token ids from processed [B, V] logits: argmax or random, per row."""
    random_rows = [i for i, row in enumerate(rows) if not row.greedy]
    if not random_rows:
        return logits.argmax(dim=-1)
    if len(random_rows) == len(rows):
        return _sample_random(logits, rows)
    tokens = logits.argmax(dim=-1)
    index = torch.tensor(random_rows, device=logits.device)
    sampled = _sample_random(logits.index_select(0, index), [rows[i] for i in random_rows])
    return tokens.index_copy_(0, index, sampled)


def argmax_and_normaliser(raw: Tensor) -> tuple[Tensor | None, Tensor]:
    """(argmax or None, log-sum-exp) of each row of raw float32 logits [R, V].

    On the CPU kernels both come from one read, by one arithmetic per row whatever the other
    rows are, so a token's logprob is the same bits in any batch; on CUDA the log-sum-exp
    is Triton's row kernel for the same reason (torch's logsumexp is used only where neither
    runs: it must never serve some rows and a kernel others)."""
    if use_cpu_kernels(raw):
        return argmax_logsumexp(raw.contiguous())
    return None, log_normaliser(raw)



def position_logprobs(logits: Tensor, token_ids: Sequence[int], top_n: int
                      ) -> list[dict[int, Logprob]]:
    """For each row of raw logits [R, V]: the logprob of `token_ids[r]` and of the `top_n`
    most likely tokens, {token id: Logprob} with ranks (prompt logprobs). The same
    arithmetic as the logprobs `Sampler` reports for a sampled token (the raw logit minus the
    row's log-sum-exp, both per row whatever the batch), so a token gets the same value
    whether it was generated or given in a prompt."""
    raw = logits.float()
    _, lse = argmax_and_normaliser(raw)
    rows = len(token_ids)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=raw.device)
    chosen = raw.gather(1, ids.unsqueeze(1))
    parts = [(chosen.squeeze(1) - lse).double(), _ranks(raw, chosen).double()]
    top_n = min(top_n, raw.shape[1])
    if top_n:
        top = raw.topk(top_n, dim=-1)
        parts += [top.indices.double().flatten(),
                  (top.values - lse.unsqueeze(1)).double().flatten()]
    host = torch.cat(parts).tolist()
    # host: [logprob per row | rank per row | top ids (row-major) | top logprobs]
    ids_at, lps_at = 2 * rows, 2 * rows + rows * top_n
    out = []
    for r, token_id in enumerate(token_ids):
        entry = {int(host[ids_at + r * top_n + m]): Logprob(host[lps_at + r * top_n + m], m + 1)
                 for m in range(top_n)}
        entry[token_id] = Logprob(host[r], int(host[rows + r]))
        out.append(entry)
    return out


def _ranks(raw: Tensor, chosen: Tensor) -> Tensor:
    """[R] vLLM's rank of each row's chosen token (`chosen`: its raw logit, [R, 1]): how many
    tokens of the row are at least as likely (1 = the most likely; exact integer counts)."""
    return (raw >= chosen).sum(dim=-1)


class Sampler:
    """Samples a batch of rows, each with its own `SamplingParams`; holds no state."""

    def __call__(self, logits: Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """One token per row of `logits` [B, V], with raw logprobs; one host sync per call.

        (On the CPU, top-p without top-k also reads back a flag per row; that is free there.)
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"sampler got logits of shape {tuple(logits.shape)} for {len(rows)} rows"
            )
        raw = logits.float()
        row_errors: dict[int, Exception] = {}
        processed = process_logits(raw, rows, row_errors)
        argmax, lse = argmax_and_normaliser(raw)
        if processed is raw and all(row.greedy for row in rows) and argmax is not None:
            tokens = argmax  # greedy on untouched logits: no second read
        else:
            tokens = choose_tokens(processed, rows)
        chosen = raw.gather(1, tokens.unsqueeze(1))
        token_lp = chosen.squeeze(1) - lse
        parts = [tokens.double(), token_lp.double()]
        # Top logprobs: one topk of the largest N over the rows that ask for N >= 1.
        top_rows = [i for i, r in enumerate(rows) if r.params.logprobs]
        top_n = max((rows[i].params.logprobs or 0 for i in top_rows), default=0)
        top_n = min(top_n, raw.shape[1])
        if top_rows:
            index = torch.tensor(top_rows, device=raw.device)
            top = raw.index_select(0, index).topk(top_n, dim=-1)
            top_lp = top.values - lse.index_select(0, index).unsqueeze(1)
            parts += [top.indices.double().flatten(), top_lp.double().flatten()]
        # Ranks of the sampled tokens, for the rows that report logprobs (logprobs=0 too).
        ranked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if ranked:
            index = torch.tensor(ranked, device=raw.device)
            parts.append(_ranks(raw.index_select(0, index), chosen.index_select(0, index))
                         .double())
        # The single device -> host transfer: token ids and ranks are exact in float64.
        # host: [tokens | logprobs | top ids | top logprobs | ranks of the `ranked` rows]
        host = torch.cat(parts).tolist()
        batch = len(rows)
        token_ids = [int(t) for t in host[:batch]]
        token_logprobs: list[float] = host[batch : 2 * batch]
        top_logprobs: list[list[tuple[int, Logprob]] | None] = [
            None if r.params.logprobs is None else [] for r in rows
        ]
        ids_at = 2 * batch
        lps_at = ids_at + len(top_rows) * top_n
        for j, i in enumerate(top_rows):
            want = min(rows[i].params.logprobs or 0, top_n)
            start = j * top_n
            top_logprobs[i] = [
                (int(host[ids_at + start + m]), Logprob(host[lps_at + start + m], m + 1))
                for m in range(want)
            ]
        ranks_at = lps_at + len(top_rows) * top_n
        for j, i in enumerate(ranked):
            token_logprobs[i] = Logprob(token_logprobs[i], int(host[ranks_at + j]))
        return SamplerOutput(token_ids, token_logprobs, top_logprobs, row_errors)


def _single_row(
    params: SamplingParams,
    generator: torch.Generator | None,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    eos_token_ids: Sequence[int] | set[int],
) -> SamplingRow:
    """A `SamplingRow` for the one-row helpers below."""
    return SamplingRow(
        params, list(prompt_token_ids), list(output_token_ids), generator, set(eos_token_ids)
    )


def filtered_probs(
    logits_row: Tensor,
    params: SamplingParams,
    *,
    prompt_token_ids: Sequence[int] = (),
    output_token_ids: Sequence[int] = (),
    eos_token_ids: Sequence[int] | set[int] = (),
) -> Tensor:
    """The [V] distribution the sampler draws from after every filter (one-hot when greedy)."""
    row = _single_row(params, None, prompt_token_ids, output_token_ids, eos_token_ids)
    logits = process_logits(logits_row.unsqueeze(0), [row])
    if row.greedy:
        probs = torch.zeros_like(logits[0])
        probs[logits[0].argmax()] = 1.0
        return probs
    return random_filter(logits, [row]).softmax(dim=-1)[0]


def sample_from_logits(
    logits_row: Tensor,
    params: SamplingParams,
    n: int = 1,
    generator: torch.Generator | None = None,
    *,
    prompt_token_ids: Sequence[int] = (),
    output_token_ids: Sequence[int] = (),
    eos_token_ids: Sequence[int] | set[int] = (),
) -> list[tuple[int, float]]:
    """n independent (token id, raw logprob) draws from one stored raw logits row [V].

    Uses the sampler's pipeline; greedy returns the argmax n times. With a generator, the
    first draw equals what `Sampler` would pick for this row with the same generator state.
    """
    if n < 1:
        raise ValueError(f"sample_from_logits needs n >= 1, got n={n}")
    raw = logits_row.float()
    if is_greedy(params) or n == 1:
        row = _single_row(params, generator, prompt_token_ids, output_token_ids, eos_token_ids)
        tokens = choose_tokens(process_logits(raw.unsqueeze(0), [row]), [row]).expand(n)
    else:
        probs = filtered_probs(
            raw,
            params,
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            eos_token_ids=eos_token_ids,
        )
        tokens = inverse_cdf(probs.unsqueeze(0), uniforms([generator], n, probs.device))[0]
    lps = raw[tokens] - argmax_and_normaliser(raw.unsqueeze(0))[1][0]
    host = torch.stack([tokens.double(), lps.double()]).tolist()
    return [(int(t), lp) for t, lp in zip(host[0], host[1], strict=True)]
