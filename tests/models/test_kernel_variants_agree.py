"""Every CPU kernel variant the host runs computes the default mode's logits bit for bit alike.

The AVX2, AVX-VNNI and AVX-512 VNNI builds differ in how they form the int8 products (and in
how many rows a tile holds), never in the value of any sum: a model's prefill chunk, its
decode steps and its logits are `torch.equal` across them, so K/V and answers computed on one
kind of host are the ones another computes.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import TinyModel, chunk

from loom.kernels.build import loaded_variant, runnable_variants, use_variant
from loom.runner import ModelRunner, build_model

VARIANTS = runnable_variants()

pytestmark = pytest.mark.skipif(
    len(VARIANTS) < 2, reason=f"this host runs {len(VARIANTS)} kernel variant(s)"
)


def _logits(model_path, variant: str) -> torch.Tensor:
    """A 37-token prompt in chunks of 20 and 17, then 3 decode steps, under `variant`."""
    with use_variant(variant):
        assert loaded_variant() == variant
        config, model = build_model(model_path, torch.float32, quantization="w8a8")
        runner = ModelRunner(config, model, "cpu", torch.float32, 64, 4,
                             kv_cache_dtype=torch.float16)
        g = torch.Generator().manual_seed(5)
        prompt = torch.randint(0, config.vocab_size, (37,), generator=g).tolist()
        total = len(prompt) + 3
        rows = [runner.execute([chunk("s", prompt[:20], 0, total, seq=0)]),
                runner.execute([chunk("s", prompt[20:], 20, total, seq=0)])]
        for step in range(3):
            rows.append(runner.execute([chunk("s", [5 + step], 37 + step, total, seq=0)]))
        assert model.fused_decoder is not None, model.fused_decode_status
        assert model.fused_decoder.max_tokens is None  # w8a8: every step runs fused
        return torch.cat(rows)


def test_every_variant_gives_the_same_logits(tiny_model: TinyModel) -> None:
    first = _logits(tiny_model.path, VARIANTS[0])
    for variant in VARIANTS[1:]:
        assert torch.equal(_logits(tiny_model.path, variant), first), variant
