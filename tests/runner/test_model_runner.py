"""ModelRunner mechanics: logits selection, block copies, KV sizing, input checks."""

from __future__ import annotations

import pytest
import torch

from loom.core.scheduler_output import ScheduledChunk
from loom.models import ModelConfig, get_model_class
from loom.models.base import CausalLM
from loom.runner import ModelRunner, kv_cache_bytes_per_block

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "vocab_size": 97,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "eos_token_id": [2, 5],
}


@pytest.fixture(scope="module")
def tiny() -> tuple[ModelConfig, CausalLM]:
    """A random-weight tiny Llama built directly (no files)."""
    config = ModelConfig.from_hf(HF_CONFIG)
    torch.manual_seed(0)
    model = get_model_class(config.architecture)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return config, model.eval()


def _runner(tiny: tuple[ModelConfig, CausalLM], dtype: torch.dtype = torch.float32) -> ModelRunner:
    config, model = tiny
    return ModelRunner(config, model, "cpu", dtype, num_blocks=16, block_size=4)


def test_model_config_fields(tiny: tuple[ModelConfig, CausalLM]) -> None:
    """ModelConfig derives head_dim, kv heads and eos ids from the HF dict."""
    config, _ = tiny
    assert (config.head_dim, config.num_kv_heads, config.eos_token_ids) == (8, 1, (2, 5))
    assert config.sliding_window is None


def test_kv_bytes_per_block(tiny: tuple[ModelConfig, CausalLM]) -> None:
    """Layers x (K and V) x block_size x kv_heads x head_dim x itemsize."""
    config, _ = tiny
    assert kv_cache_bytes_per_block(config, 16, torch.bfloat16) == 2 * 2 * 16 * 1 * 8 * 2
    runner = _runner(tiny)
    assert runner.kv_caches[0].shape == (2, 16, 4, 1, 8)


def test_logits_only_for_chunks_that_need_them(tiny: tuple[ModelConfig, CausalLM]) -> None:
    """Rows follow chunk order and skip chunks with needs_logits=False."""
    a = ScheduledChunk("a", [3, 4, 5, 6, 7], 0, [0, 1], True)
    b = ScheduledChunk("b", [8, 9], 0, [2], False)
    c = ScheduledChunk("c", [10, 11, 12], 0, [3], True)
    together = _runner(tiny).execute([a, b, c])
    alone_a = _runner(tiny).execute([a])
    alone_c = _runner(tiny).execute([c])
    assert together.shape == (2, 97) and together.dtype == torch.float32
    torch.testing.assert_close(together[0], alone_a[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(together[1], alone_c[0], atol=1e-5, rtol=0)


def test_copy_blocks_forks_the_cache(tiny: tuple[ModelConfig, CausalLM]) -> None:
    """After copying a sequence's blocks, decoding on the copy equals decoding on the original."""
    runner = _runner(tiny)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    runner.execute([ScheduledChunk("p", prompt, 0, [5, 6], False)])
    runner.copy_blocks([(5, 9), (6, 10)])
    orig = runner.execute([ScheduledChunk("p", [6], 7, [5, 6], True)])
    fork = runner.execute([ScheduledChunk("c", [6], 7, [9, 10], True)])
    torch.testing.assert_close(orig, fork, atol=0, rtol=0)


def test_too_few_blocks_rejected(tiny: tuple[ModelConfig, CausalLM]) -> None:
    """A chunk whose blocks cannot hold its positions is refused with its request id."""
    with pytest.raises(ValueError, match="req-7"):
        _runner(tiny).execute([ScheduledChunk("req-7", [1] * 5, 0, [0], True)])


def test_bfloat16_runs_and_returns_float32(tiny: tuple[ModelConfig, CausalLM]) -> None:
    """A bf16 model and cache (prefill, then decodes reading the bf16 cache) return float32
    logits within bf16 rounding of the float32 ones.

    bf16 keeps 8 significant bits: a rounding is off by up to 2^-8 of the value. The logits
    round once at the end and carry the rounding of weights, activations and K/V: measured
    1 to 2 units of 2^-8 * max|logit| here; 4 leaves room for other summation orders (AVX-512
    BF16, CUDA). A decode that misses its own key is off by 7 to 22 units.
    """
    config, model = tiny
    tokens, split = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], 11
    bf16_model = get_model_class(config.architecture)(config).to(torch.bfloat16).eval()
    bf16_model.load_state_dict(model.state_dict())

    def logits(m: CausalLM, dtype: torch.dtype) -> torch.Tensor:
        runner = ModelRunner(config, m, "cpu", dtype, 16, 4)
        blocks = [7, 2, 5, 0]
        rows = [runner.execute([ScheduledChunk("a", tokens[:split], 0, blocks, True)])]
        for p in range(split, len(tokens)):
            rows.append(runner.execute([ScheduledChunk("a", [tokens[p]], p, blocks, True)]))
        return torch.cat(rows)

    ref = logits(model, torch.float32)
    out = logits(bf16_model, torch.bfloat16)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=4 * 2**-8 * float(ref.abs().max()), rtol=0)
