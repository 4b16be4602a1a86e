"""Loom vs transformers logits on tiny random models of every supported architecture."""

from __future__ import annotations

import torch
from tiny_models import PARITY_ATOL, TinyModel, chunk

ATOL = PARITY_ATOL


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def test_one_shot_prefill_matches(tiny_model: TinyModel) -> None:
    """A whole prompt in one chunk gives the reference logits of its last token."""
    tokens = _prompt(21, 1, tiny_model.loom_config.vocab_size)
    ref = tiny_model.reference_logits(tokens)
    out = tiny_model.runner().execute([chunk("a", tokens, 0, len(tokens), seq=0)])
    assert out.shape == (1, tiny_model.loom_config.vocab_size)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out[0], ref[-1], atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_matches(tiny_model: TinyModel) -> None:
    """Prefill in three chunks through the paged cache, then decode token by token."""
    tokens = _prompt(30, 2, tiny_model.loom_config.vocab_size)
    ref = tiny_model.reference_logits(tokens)
    runner = tiny_model.runner()
    total = len(tokens)
    got: dict[int, torch.Tensor] = {}
    for lo, hi in ((0, 7), (7, 10), (10, 19)):  # uneven, crossing block boundaries
        out = runner.execute([chunk("a", tokens[lo:hi], lo, total, seq=0)])
        got[hi - 1] = out[0]
    for pos in range(19, total):
        out = runner.execute([chunk("a", [tokens[pos]], pos, total, seq=0)])
        got[pos] = out[0]
    for pos, logits in got.items():
        torch.testing.assert_close(logits, ref[pos], atol=ATOL, rtol=0, msg=f"position {pos}")


def test_mixed_batch_matches(tiny_model: TinyModel) -> None:
    """One step mixing decodes and prefill chunks of different lengths and offsets."""
    vocab = tiny_model.loom_config.vocab_size
    seqs = [_prompt(n, 10 + i, vocab) for i, n in enumerate((26, 13, 5, 17))]
    refs = [tiny_model.reference_logits(s) for s in seqs]
    runner = tiny_model.runner()
    # Step 1: prefixes of different lengths (seq 3 gets no logits).
    cut = [25, 12, 3, 9]
    step1 = [
        chunk(f"r{i}", s[: cut[i]], 0, len(s), seq=i, needs_logits=i != 3)
        for i, s in enumerate(seqs)
    ]
    out = runner.execute(step1)
    assert out.shape[0] == 3
    for row, i in enumerate((0, 1, 2)):
        torch.testing.assert_close(out[row], refs[i][cut[i] - 1], atol=ATOL, rtol=0)
    # Step 2: decodes (seqs 0, 1) mixed with prefill chunks (seqs 2, 3), all to the end.
    step2 = [chunk(f"r{i}", s[cut[i]:], cut[i], len(s), seq=i) for i, s in enumerate(seqs)]
    out = runner.execute(step2)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(out[i], refs[i][len(s) - 1], atol=ATOL, rtol=0)


def test_batched_decode_matches(tiny_model: TinyModel) -> None:
    """Pure-decode steps over sequences of different lengths (the batched gather path)."""
    vocab = tiny_model.loom_config.vocab_size
    seqs = [_prompt(n, 20 + i, vocab) for i, n in enumerate((24, 11, 18))]
    refs = [tiny_model.reference_logits(s) for s in seqs]
    runner = tiny_model.runner()
    pre = [len(s) - 4 for s in seqs]
    runner.execute(
        [chunk(f"r{i}", s[: pre[i]], 0, len(s), seq=i) for i, s in enumerate(seqs)]
    )
    for step in range(4):
        batch = [
            chunk(f"r{i}", [s[pre[i] + step]], pre[i] + step, len(s), seq=i)
            for i, s in enumerate(seqs)
        ]
        out = runner.execute(batch)
        for i in range(len(seqs)):
            torch.testing.assert_close(out[i], refs[i][pre[i] + step], atol=ATOL, rtol=0)


def test_empty_and_no_logits(tiny_model: TinyModel) -> None:
    """No chunks, or no chunk needing logits, gives an empty [0, V] float32 tensor."""
    vocab = tiny_model.loom_config.vocab_size
    runner = tiny_model.runner()
    assert runner.execute([]).shape == (0, vocab)
    out = runner.execute([chunk("a", [1, 2, 3], 0, 3, seq=0, needs_logits=False)])
    assert out.shape == (0, vocab) and out.dtype == torch.float32
