"""gpt-oss (HF form, exact float32) against transformers, and its parts: attention sinks in
the backends against a direct softmax, YaRN's frequencies, the fused expert tensors' split,
the C paths that run it (the fused CPU decoder, the MoE block) and tensor parallelism, which
declines it."""

from __future__ import annotations

import inspect
import math
from dataclasses import replace

import pytest
import torch
from engine.helpers import make_engine, run_to_completion
from tiny_models import PARITY_ATOL, chunk
from tiny_reference import (
    GPT_OSS_WINDOW,
    GPT_OSS_YARN,
    build_tiny_gpt_oss,
    hf_greedy,
    tiny_gpt_oss_config,
)

from loom import SamplingParams
from loom.attention import AttentionMetadata, AttentionSpec
from loom.attention.cpu_backend import CpuAttentionBackend
from loom.attention.torch_backend import TorchAttentionBackend
from loom.attention.triton_backend import triton_available
from loom.errors import InvalidModelError, UnsupportedModelError
from loom.kernels import cpu_kernels_available, paged_attention
from loom.models.config import ModelConfig
from loom.models.expert_tensors import split_expert_tensors
from loom.models.gpt_oss import GptOssForCausalLM
from loom.models.moe import SparseMoE, route_topk_logits
from loom.models.rope import inverse_frequencies, resolve_rope
from loom.models.tensor_parallel import check_shardable
from loom.runner import ModelRunner, build_model

WINDOW = GPT_OSS_WINDOW  # the sliding layers' window: prompts below are several windows long
PROMPT_LEN, NEW_TOKENS = 30, 16
YARN = GPT_OSS_YARN


def _cpu_kernel_has_sinks() -> bool:
    return cpu_kernels_available() and "sinks" in inspect.signature(paged_attention).parameters


# The CPU backend reads decode rows with the C kernel, which takes sinks once it has them.
BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    not _cpu_kernel_has_sinks(), reason="the CPU attention kernel has no sinks"))]
# The Triton kernels too where they compile (Triton's interpreter takes 5 s for the model:
# on a CPU the backends' test below covers them).
LOGITS_BACKENDS = [*BACKENDS, pytest.param("triton", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="Triton compiles on CUDA only"))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, transformers model, prompt longer than several windows)."""
    folder = tmp_path_factory.mktemp("gpt-oss")
    model = build_tiny_gpt_oss(folder)
    prompt = torch.randint(3, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    return folder, model, prompt.tolist()


# ---- the model against transformers -------------------------------------------------


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_chunked_prefill_and_decode_logits_equal_transformers(tiny, backend):
    """Every position's logits, from three prefill chunks (crossing blocks and windows) and
    then decodes, within PARITY_ATOL of transformers' float32 logits."""
    folder, hf, prompt = tiny
    tokens = prompt + hf_greedy(hf, prompt, 6)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    device = "cuda" if backend == "triton" else "cpu"
    config, model = build_model(folder, dtype=torch.float32, device=device)
    runner = ModelRunner(config, model, device, torch.float32, 64, 4,
                         attention_backend=backend)
    total, got = len(tokens), {}
    for lo, hi in ((0, 11), (11, 19), (19, PROMPT_LEN)):
        got[hi - 1] = runner.execute([chunk("a", tokens[lo:hi], lo, total, seq=0)])[0]
    for pos in range(PROMPT_LEN, total):
        got[pos] = runner.execute([chunk("a", [tokens[pos]], pos, total, seq=0)])[0]
    worst = max(float((logits.cpu() - ref[pos]).abs().max()) for pos, logits in got.items())
    assert worst <= PARITY_ATOL, worst
    # The fused C decoder runs the model's decodes (sinks, the biased top-k-logits router,
    # biased experts, the clamped SwiGLU); the torch backend's chunks are the reference.
    if backend != "triton" and cpu_kernels_available():
        assert model.fused_decode_status == "ok"


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_equal_transformers(tiny, backend):
    """LLM-engine greedy decoding with chunked prefill: transformers' tokens, and its first
    token's log-probabilities."""
    folder, hf, prompt = tiny
    want = hf_greedy(hf, prompt, NEW_TOKENS)
    assert len(set(want)) > NEW_TOKENS // 2  # not a degenerate repetition
    with torch.no_grad():
        first = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
    engine = make_engine(folder, attention_backend=backend, max_num_batched_tokens=12)
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                   logprobs=5))
    out = run_to_completion(engine)["a"].outputs[0]
    assert out.token_ids == want
    for token, logprob in out.logprobs[0].items():
        assert float(logprob.logprob) == pytest.approx(float(first[token]), abs=PARITY_ATOL)
    assert engine.kv_pool_all_free


def test_sinks_and_window_matter(tiny):
    """The reference itself moves when the sinks are zeroed or the window widened, so the
    parity tests above would see either one wrong."""
    import transformers as tf

    folder, hf, prompt = tiny
    with torch.no_grad():
        base = hf(torch.tensor([prompt])).logits[0, -1]
        saved = [layer.self_attn.sinks.clone() for layer in hf.model.layers]
        for layer in hf.model.layers:
            layer.self_attn.sinks.zero_()
        no_sinks = hf(torch.tensor([prompt])).logits[0, -1]
        for layer, s in zip(hf.model.layers, saved, strict=True):
            layer.self_attn.sinks.copy_(s)
        wide = tf.AutoModelForCausalLM.from_pretrained(str(folder), sliding_window=64).eval()
        wide_logits = wide(torch.tensor([prompt])).logits[0, -1]
    assert float((base - no_sinks).abs().max()) > 100 * PARITY_ATOL
    assert float((base - wide_logits).abs().max()) > 100 * PARITY_ATOL


# ---- attention sinks in the backends ------------------------------------------------


def _direct(q, keys, values, first_pos, scale, window, sinks):
    """Row by row: weights = exp(s - M) / (sum exp(s - M) + exp(sink - M)), M the max over
    the visible scores and the sink; q [T, H, D] at positions first_pos.., keys/values
    [L, Hkv, D] at 0..L-1."""
    t, h, _ = q.shape
    group = h // keys.shape[1]
    out = torch.zeros_like(q, dtype=torch.float64)
    for i in range(t):
        pos = first_pos + i
        lo = max(0, pos - window + 1) if window else 0
        for head in range(h):
            k = keys[lo:pos + 1, head // group].double()
            v = values[lo:pos + 1, head // group].double()
            s = (k @ q[i, head].double()) * scale
            sink = float(sinks[head])
            m = max(float(s.max()), sink)
            e = torch.exp(s - m)
            out[i, head] = (e @ v) / (float(e.sum()) + math.exp(sink - m))
    return out.float()


def _triton(split: bool):
    def make():
        from loom.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(split=split, part_keys=32)  # several parts a context
    return pytest.param(make, id=f"triton-split-{split}", marks=pytest.mark.skipif(
        not triton_available(), reason="no triton"))


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("make_backend", [
    pytest.param(TorchAttentionBackend, id="torch"),
    pytest.param(CpuAttentionBackend, id="cpu", marks=pytest.mark.skipif(
        not _cpu_kernel_has_sinks(), reason="the CPU attention kernel has no sinks")),
    _triton(False), _triton(True),  # one program folds an item's parts / the merge does
])
def test_sinks_equal_a_direct_softmax(make_backend, window):
    """A prefill chunk after a cached prefix beside a decode, GQA, sinks of both signs."""
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 16, 4
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0])
    spec = AttentionSpec(heads, kv_heads, dim, dim ** -0.5, sliding_window=window, sinks=sinks)
    backend = make_backend()
    # Sequence 0: 38 cached tokens, a chunk of 7; sequence 1: 69 cached, one decode token.
    lengths, chunks = [45, 70], [7, 1]
    ids = torch.randperm(32).tolist()  # blocks in no order
    blocks = [ids[:12], ids[12:30]]
    cache = torch.zeros(2, 32, block, kv_heads, dim)
    keys = [torch.randn(n, kv_heads, dim) for n in lengths]
    values = [torch.randn(n, kv_heads, dim) for n in lengths]
    for seq, n in enumerate(lengths):  # the cached prefixes, in place
        for pos in range(n - chunks[seq]):
            b, off = divmod(pos, block)
            cache[0, blocks[seq][b], off], cache[1, blocks[seq][b], off] = (
                keys[seq][pos], values[seq][pos])
    q = [torch.randn(c, heads, dim) for c in chunks]
    md = AttentionMetadata.build([n - c for n, c in zip(lengths, chunks, strict=True)], chunks,
                                 blocks, block)
    new_k = torch.cat([k[-c:] for k, c in zip(keys, chunks, strict=True)])
    new_v = torch.cat([v[-c:] for v, c in zip(values, chunks, strict=True)])
    out = backend.forward(spec, torch.cat(q), new_k, new_v, cache, md)
    want = torch.cat([_direct(q[s], keys[s], values[s], lengths[s] - chunks[s], spec.scale,
                              window, sinks) for s in range(2)])
    torch.testing.assert_close(out.view_as(want), want, atol=1e-5, rtol=0)
    # No sinks: the ordinary softmax, the formula with sinks of -inf (weights summing to one).
    plain = backend.forward(replace(spec, sinks=None), torch.cat(q), new_k, new_v,
                            cache.clone(), md)
    want = torch.cat([_direct(q[s], keys[s], values[s], lengths[s] - chunks[s], spec.scale,
                              window, torch.full((heads,), -math.inf)) for s in range(2)])
    torch.testing.assert_close(plain.view_as(want), want, atol=1e-5, rtol=0)


def test_spec_rejects_sinks_of_the_wrong_size():
    with pytest.raises(ValueError, match="one logit per head"):
        AttentionSpec(4, 2, 16, 0.25, sinks=torch.zeros(2))


# ---- YaRN, routing, the expert tensors ----------------------------------------------


@pytest.mark.parametrize("params", [
    YARN,
    {"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 32.0, "beta_fast": 32.0,
     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
     "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.5},
])
def test_yarn_frequencies_and_factor_equal_transformers(params):
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tf.GptOssConfig(head_dim=64, num_attention_heads=4, hidden_size=64,
                             max_position_embeddings=int(
                                 params["factor"] * params["original_max_position_embeddings"]),
                             rope_parameters=dict(params))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    spec = resolve_rope(config.to_dict())
    assert torch.equal(inverse_frequencies(spec, 64), inv_freq)
    assert spec.attention_factor == pytest.approx(factor, rel=1e-15)


def test_topk_softmax_routing_is_a_softmax_over_the_chosen_logits():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [2.0, -1.0, 0.5, 1.0]])
    weights, experts = route_topk_logits(logits, 2)
    assert experts.tolist() == [[1, 3], [0, 3]]  # ties to the lower index
    torch.testing.assert_close(weights[1], torch.softmax(torch.tensor([2.0, 1.0]), -1))
    assert torch.equal(weights[0], torch.tensor([0.5, 0.5]))


def test_fused_expert_tensors_split_per_expert_with_gate_and_up_interleaved():
    rules = GptOssForCausalLM.fused_expert_tensors
    gate_up = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)  # [E, in, 2I]
    bias = torch.arange(2 * 4, dtype=torch.float32).view(2, 4)
    other = torch.ones(3)
    pieces = dict(split_expert_tensors([
        ("model.layers.0.mlp.experts.gate_up_proj", gate_up),
        ("model.layers.0.mlp.experts.gate_up_proj_bias", bias),
        ("model.layers.0.input_layernorm.weight", other)], rules))
    p = "model.layers.0.mlp.experts."
    assert list(pieces) == [
        p + "0.gate_proj.weight", p + "0.up_proj.weight", p + "1.gate_proj.weight",
        p + "1.up_proj.weight", p + "0.gate_proj.bias", p + "0.up_proj.bias",
        p + "1.gate_proj.bias", p + "1.up_proj.bias", "model.layers.0.input_layernorm.weight"]
    assert torch.equal(pieces[p + "1.gate_proj.weight"], gate_up[1].T[0::2])
    assert torch.equal(pieces[p + "1.up_proj.weight"], gate_up[1].T[1::2])
    assert pieces[p + "1.up_proj.weight"].is_contiguous()
    assert torch.equal(pieces[p + "0.up_proj.bias"], bias[0, 1::2])
    with pytest.raises(InvalidModelError, match="gate_up_proj'"):
        list(split_expert_tensors([(p + "gate_up_proj", torch.zeros(2, 3, 5))], rules))


# ---- what declines the model --------------------------------------------------------


def test_moe_block_runs_in_c_and_tensor_parallel_refuses(tiny):
    folder, _, _ = tiny
    config, model = build_model(folder, dtype=torch.float32)
    moe = model.model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and moe.scoring == "topk_softmax"
    x = torch.randn(3, 64)
    torch.testing.assert_close(moe(x), moe.forward_modules(x), atol=2e-5, rtol=1e-4)
    if cpu_kernels_available():
        assert moe._kernel_status == "ok"
    with pytest.raises(UnsupportedModelError, match="GptOssForCausalLM does not split"):
        check_shardable(config, 2)
    check_shardable(config, 1)


def test_mxfp4_checkpoints_are_refused():
    hf = {**tiny_gpt_oss_config().to_dict(), "architectures": ["GptOssForCausalLM"],
          "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(UnsupportedModelError, match="'mxfp4'"):
        GptOssForCausalLM(ModelConfig.from_hf(hf))
