"""The fused CPU decode path (one C call for all layers) against the module path."""

from __future__ import annotations

import pytest
import torch
from tiny_models import PARITY_ATOL, TinyModel, chunk

from loom.kernels import cpu_kernels_available, kernel_status
from loom.runner import ModelRunner, build_model

pytestmark = [
    pytest.mark.skipif(
        not cpu_kernels_available(), reason=f"CPU kernels unavailable: {kernel_status()}"
    ),
    pytest.mark.usefixtures("each_kernel_variant"),
]

LENGTHS = [11, 3, 17]  # three sequences; Gemma's sliding window (8) cuts two of them


def _decode_logits(runner: ModelRunner, prompts: list[list[int]], steps: int,
                   fused: bool, together: bool = True) -> list[torch.Tensor]:
    """Prefill each prompt, then decode `steps` forced tokens; logits [steps, V] per sequence.

    `together=False` decodes each sequence in a batch of its own.
    """
    runner.model.use_fused_decode = fused
    total = [len(p) + steps for p in prompts]
    for i, p in enumerate(prompts):
        runner.execute([chunk(f"s{i}", p, 0, total[i], seq=i)])
    out: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in range(steps):
        token = 7 + step
        chunks = [chunk(f"s{i}", [token], len(p) + step, total[i], seq=i)
                  for i, p in enumerate(prompts)]
        groups = [chunks] if together else [[c] for c in chunks]
        rows = torch.cat([runner.execute(g) for g in groups])
        for i in range(len(prompts)):
            out[i].append(rows[i])
    runner.model.use_fused_decode = True
    return [torch.stack(o) for o in out]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.mark.parametrize("quantization", [None, "w8a8"])
def test_fused_decode_matches_module_path(tiny_model: TinyModel, quantization: str | None) -> None:
    """Batched decode steps: fused logits equal the module path's to float rounding.

    (w8a8 rounds activations to int8, where a last-bit difference upstream (the C GELU against
    torch's) can move a value across a rounding boundary: compared at 1% of the logit range.)
    """
    config, model = build_model(tiny_model.path, torch.float32, quantization=quantization)
    prompts = _prompts(config.vocab_size)
    fused = _decode_logits(ModelRunner(config, model, "cpu", torch.float32, 64, 4), prompts, 5,
                           fused=True)
    assert model.fused_decoder is not None, model.fused_decode_status
    modules = _decode_logits(ModelRunner(config, model, "cpu", torch.float32, 64, 4), prompts, 5,
                             fused=False)
    for f, m in zip(fused, modules, strict=True):
        atol = 2e-5 if quantization is None else 0.01 * float(m.abs().max())
        torch.testing.assert_close(f, m, atol=atol, rtol=2e-5)


def test_fused_decode_reads_and_writes_float16_caches(tiny_model: TinyModel) -> None:
    """kv_cache_dtype float16: the fused step stores K/V rounded as torch rounds them and
    attends over the values the module path reads. (A last-bit difference upstream can move a
    K/V element across a float16 rounding boundary: compared at 0.1% of the logit range; a
    wrong layout or conversion is off by the whole range.) Both stay near float32 caches."""
    config, model = build_model(tiny_model.path, torch.float32)
    prompts = _prompts(config.vocab_size)

    def runner(kv_dtype: torch.dtype) -> ModelRunner:
        return ModelRunner(config, model, "cpu", torch.float32, 64, 4, kv_cache_dtype=kv_dtype)

    half = runner(torch.float16)
    fused = _decode_logits(half, prompts, 5, fused=True)
    assert half.kv_caches[0].dtype == torch.float16
    modules = _decode_logits(runner(torch.float16), prompts, 5, fused=False)
    full = _decode_logits(runner(torch.float32), prompts, 5, fused=True)
    for f, m, ref in zip(fused, modules, full, strict=True):
        torch.testing.assert_close(f, m, atol=1e-3 * float(m.abs().max()), rtol=0.0)
        torch.testing.assert_close(f, ref, atol=0.02 * float(ref.abs().max()), rtol=0.0)


def test_fused_decode_is_batch_invariant(tiny_model: TinyModel) -> None:
    """A sequence's logits are bit-identical whether it decodes alone or with others."""
    config, model = build_model(tiny_model.path, torch.float32, quantization="w8a8")
    prompts = _prompts(config.vocab_size)
    batched = _decode_logits(ModelRunner(config, model, "cpu", torch.float32, 64, 4), prompts,
                             4, fused=True)
    alone = _decode_logits(ModelRunner(config, model, "cpu", torch.float32, 64, 4), prompts, 4,
                           fused=True, together=False)
    for b, a in zip(batched, alone, strict=True):
        assert torch.equal(b, a)


def test_fused_decode_matches_transformers(tiny_model: TinyModel) -> None:
    """Float32 fused decode logits equal transformers over the whole sequence (1e-4)."""
    prompts = _prompts(tiny_model.loom_config.vocab_size)
    got = _decode_logits(tiny_model.runner(), prompts, 4, fused=True)
    assert tiny_model.loom_model.fused_decoder is not None
    for p, logits in zip(prompts, got, strict=True):
        # Row j holds the logits after token 7 + j, the reference's row len(p) + j.
        ref = tiny_model.reference_logits(p + [7, 8, 9, 10])[len(p) : len(p) + 4]
        torch.testing.assert_close(logits, ref, atol=PARITY_ATOL, rtol=1e-4)


def test_fused_decode_follows_a_new_runners_caches(tiny_model: TinyModel) -> None:
    """A second runner (new KV caches, possibly at a freed one's addresses) is written, and
    the first runner's caches are not touched."""
    config, model = build_model(tiny_model.path, torch.float32)
    prompts = _prompts(config.vocab_size)
    first = ModelRunner(config, model, "cpu", torch.float32, 64, 4)
    expected = _decode_logits(first, prompts, 2, fused=True)
    snapshot = [c.clone() for c in first.kv_caches]
    second = ModelRunner(config, model, "cpu", torch.float32, 64, 4)
    got = _decode_logits(second, prompts, 2, fused=True)
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)
    for before, cache in zip(snapshot, first.kv_caches, strict=True):
        # Bit for bit: slots never written hold whatever the allocator gave (NaN included).
        assert torch.equal(before.view(torch.int32), cache.view(torch.int32))
