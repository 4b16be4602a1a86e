"""The tiny models see position: a RoPE or position bug fails the parity tests by far.

Each test runs Loom (or transformers) with a deliberate position error and asserts that the
logits move from transformers' by more than FAR, a hundred times the tolerance of the parity
tests (test_hf_parity.py, test_fused_decode_matches_transformers). Measured: every such error
moves them by at least 1.8 FAR (1.8e-2); Loom's own float32 error is below 5e-7.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from tiny_models import PARITY_ATOL, TinyModel, chunk

from loom.attention import AttentionMetadata
from loom.models.rope import RotaryEmbedding
from loom.runner import ModelRunner, build_model

FAR = 100 * PARITY_ATOL


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _worst(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Largest absolute logit difference of each row [N]."""
    return (got - ref).abs().amax(dim=-1)


def _edit_positions(
    runner: ModelRunner, edit: Callable[[AttentionMetadata], torch.Tensor | None]
) -> None:
    """Make `runner` compute at the positions `edit` returns (K/V slots unchanged)."""
    build = runner.build_metadata

    def edited(chunks: list) -> AttentionMetadata:
        md = build(chunks)
        positions = edit(md)
        if positions is not None:
            md.positions = positions
        return md

    runner.build_metadata = edited  # type: ignore[method-assign]


def test_swapping_adjacent_tokens_moves_later_logits(tiny_model: TinyModel) -> None:
    """For every adjacent pair of a prompt, swapping the two tokens moves transformers'
    logits of the rows after them (same token, same context set, other order) past FAR."""
    tokens = _prompt(24, 2, tiny_model.loom_config.vocab_size)
    ref = tiny_model.reference_logits(tokens)
    pairs = range(len(tokens) - 2)
    swapped = [tokens[:i] + [tokens[i + 1], tokens[i]] + tokens[i + 2 :] for i in pairs]
    with torch.no_grad():
        logits = tiny_model.hf_model(torch.tensor(swapped)).logits.float()
    moved = [float(_worst(logits[i, i + 2 :], ref[i + 2 :]).max()) for i in pairs]
    assert min(moved) > FAR, moved


def test_decode_positions_off_by_one_fail_parity(tiny_model: TinyModel) -> None:
    """Decode steps one position ahead of their cache (prefill right) miss every row by FAR."""
    tokens = _prompt(30, 2, tiny_model.loom_config.vocab_size)
    ref = tiny_model.reference_logits(tokens)
    runner = tiny_model.runner()
    _edit_positions(runner, lambda md: md.positions + 1 if md.is_pure_decode else None)
    runner.execute([chunk("a", tokens[:20], 0, len(tokens), seq=0)])
    rows = [runner.execute([chunk("a", [tokens[p]], p, len(tokens), seq=0)])[0]
            for p in range(20, len(tokens))]
    worst = _worst(torch.stack(rows), ref[20:])
    assert float(worst.min()) > FAR, worst


def test_prefill_positions_swapped_fail_parity(tiny_model: TinyModel) -> None:
    """A one-shot prefill whose positions 9 and 10 are exchanged misses the last row by FAR."""
    tokens = _prompt(21, 1, tiny_model.loom_config.vocab_size)
    ref = tiny_model.reference_logits(tokens)
    runner = tiny_model.runner()
    _edit_positions(runner, lambda md: md.positions[[*range(9), 10, 9, *range(11, 21)]])
    out = runner.execute([chunk("a", tokens, 0, len(tokens), seq=0)])
    assert float(_worst(out, ref[-1:])[0]) > FAR


@pytest.mark.parametrize("tiny_model", ["gemma3", "llama"], indirect=True)
def test_rope_scaling_removed_fails_parity(tiny_model: TinyModel) -> None:
    """Loom without the config's RoPE scaling (Gemma 3: linear on the global layer, Llama:
    llama3) misses transformers by FAR in prefill and in every decode row."""
    config, model = build_model(tiny_model.path, torch.float32)
    scaled = 0
    for layer in model.model.layers:
        spec = layer.self_attn.rotary.spec
        if spec.rope_type != "default":
            unscaled = replace(spec, rope_type="default")
            layer.self_attn.rotary = RotaryEmbedding(config.head_dim, unscaled)
            scaled += 1
    assert scaled > 0
    tokens = _prompt(30, 2, config.vocab_size)
    ref = tiny_model.reference_logits(tokens)
    runner = ModelRunner(config, model, "cpu", torch.float32, 64, 4)
    rows = [runner.execute([chunk("a", tokens[:20], 0, len(tokens), seq=0)])[0]]
    rows += [runner.execute([chunk("a", [tokens[p]], p, len(tokens), seq=0)])[0]
             for p in range(20, len(tokens))]
    worst = _worst(torch.stack(rows), ref[19:])
    assert float(worst.min()) > FAR, worst
