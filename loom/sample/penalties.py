"""Argmax-changing logits edits, applied to every row: logits processors, logit bias,
min_tokens, penalties.

Order (vLLM): per-request logits processors, the logit bias, then min_tokens masking, then
the penalties.
All take float32 [B, V] logits; only `apply_logits_processors` edits its input in place.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from loom.sample.rows import SamplingRow


def _call_processor(proc: Callable[..., Any], row: SamplingRow, logits_row: Tensor) -> Tensor:
    """Calls a vLLM-V0 style processor: (output_ids, logits) or (prompt_ids, output_ids, logits)."""
    try:
        arity = len(inspect.signature(proc).parameters)
    except (TypeError, ValueError):  # builtins without a signature: assume the 2-argument form
        arity = 2
    if arity >= 3:
        return proc(list(row.prompt_token_ids), list(row.output_token_ids), logits_row)
    return proc(list(row.output_token_ids), logits_row)


def apply_logits_processors(
    logits: Tensor, rows: Sequence[SamplingRow], errors: dict[int, Exception] | None = None
) -> None:
    """Runs each row's `params.logits_processors` in order over its row, in place.

    With `errors`, an exception from a row's processor is recorded there under the row's
    index and the other rows go on (that row may be left half-processed: the caller restores
    it); without, it propagates."""
    for i, row in enumerate(rows):
        try:
            for proc in row.params.logits_processors or ():
                out = _call_processor(proc, row, logits[i])
                if out.data_ptr() != logits[i].data_ptr():  # returned a new tensor, not the view
                    logits[i] = out
        except Exception as exc:
            if errors is None:
                raise
            errors[i] = exc


def apply_min_tokens(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """Stop/eos logits set to -inf on rows short of `min_tokens` (a new tensor if any)."""
    vocab = logits.shape[1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, row in enumerate(rows):
        for tok in row.suppressed_token_ids():
            if tok < vocab:
                row_idx.append(i)
                tok_idx.append(tok)
    if not row_idx:
        return logits
    dev = logits.device
    index = (torch.tensor(row_idx, device=dev), torch.tensor(tok_idx, device=dev))
    return logits.index_put(index, torch.tensor(float("-inf"), device=dev))


def _token_counts(id_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> Tensor:
    """[len(id_lists), vocab] float32 counts of each token id per list (ids >= vocab ignored).

    One extra column collects out-of-range ids and is dropped:
        counts[:, 0 .. vocab-1] | counts[:, vocab]  <- ids >= vocab land here
    """
    lengths = torch.tensor([len(ids) for ids in id_lists], device=device)
    flat = torch.tensor(list(chain.from_iterable(id_lists)), dtype=torch.long, device=device)
    rows = torch.repeat_interleave(torch.arange(len(id_lists), device=device), lengths)
    counts = torch.zeros(len(id_lists), vocab + 1, dtype=torch.float32, device=device)
    ones = torch.ones(flat.numel(), dtype=torch.float32, device=device)
    counts.index_put_((rows, flat.clamp_(0, vocab)), ones, accumulate=True)
    return counts[:, :vocab]


def penalize(
    logits: Tensor,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    repetition: Sequence[float],
    presence: Sequence[float],
    frequency: Sequence[float],
) -> Tensor:
    """Applies vLLM/HF penalties to [R, V] logits given per-row token lists and factors.

    repetition (over prompt and output tokens): positive logits divided, others multiplied;
    then logits -= frequency * output_count + presence * (output_count > 0).
    """
    dev = logits.device
    vocab = logits.shape[1]
    out_counts = _token_counts(output_ids, vocab, dev)
    if any(r != 1.0 for r in repetition):
        seen = _token_counts(prompt_ids, vocab, dev).add_(out_counts) > 0
        rep = torch.tensor(repetition, dtype=torch.float32, device=dev).unsqueeze(1)
        factor = torch.where(seen, rep, 1.0)
        logits = torch.where(logits > 0, logits / factor, logits * factor)
    if any(f != 0.0 for f in frequency):
        freq = torch.tensor(frequency, dtype=torch.float32, device=dev).unsqueeze(1)
        logits = logits - freq * out_counts
    if any(p != 0.0 for p in presence):
        pres = torch.tensor(presence, dtype=torch.float32, device=dev).unsqueeze(1)
        logits = logits - pres * (out_counts > 0)
    return logits


def apply_penalties(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """Each row's penalties applied (a new tensor); rows without any are copied unchanged."""
    idx = [i for i, row in enumerate(rows) if row.has_penalties]
    if not idx:
        return logits
    sub_rows = [rows[i] for i in idx]
    whole = len(idx) == len(rows)
    index = None if whole else torch.tensor(idx, device=logits.device)
    sub = logits if index is None else logits.index_select(0, index)
    sub = penalize(
        sub,
        [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else () for r in sub_rows],
        [r.output_token_ids for r in sub_rows],
        [r.params.repetition_penalty for r in sub_rows],
        [r.params.presence_penalty for r in sub_rows],
        [r.params.frequency_penalty for r in sub_rows],
    )
    return sub if index is None else logits.index_copy(0, index, sub)


def apply_logit_bias(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """Each row's `params.logit_bias` added to its logits, all rows in one scatter (a new
    tensor if any row has a bias; ids past the vocabulary are the input processor's to
    refuse)."""
    row_idx: list[int] = []
    tok_idx: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        for tok, bias in (row.params.logit_bias or {}).items():
            row_idx.append(i)
            tok_idx.append(tok)
            values.append(float(bias))
    if not row_idx:
        return logits
    out = logits.clone()
    device = logits.device
    out.index_put_(
        (torch.tensor(row_idx, device=device), torch.tensor(tok_idx, device=device)),
        torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)
    return out
