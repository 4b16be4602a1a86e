"""The mixture-of-experts block in C (cpu/moe.c: `loom_moe_route`, `loom_moe_ffn`, and the
block inside the fused decoder) against the torch routing and expert modules, and against an
oracle composed one (token, slot) at a time from the single-layer kernels' references: equal
to float rounding with float32 experts, bit for bit in the integer modes, and every token's
output the same bits whatever else is in its call, on every kernel variant this CPU runs."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from engine.helpers import make_engine, run_to_completion
from tiny_gguf import Q4_K, Q6_K, Q8_0, random_blocks
from tiny_reference import build_tiny_model

from loom import SamplingParams
from loom.kernels import (
    cpu_kernels_available,
    gated_act,
    kernel_status,
    linear_f32,
    linear_w4a8,
    linear_w8,
    linear_w8a8_reference,
    moe_route,
    w4a8_pack,
)
from loom.kernels.build import runnable_variants, use_variant
from loom.models.layers import ClampedSwiGLU
from loom.models.moe import SparseMoE, combine_slots, route_topk
from loom.models.moe_kernel import MoEKernel
from loom.models.quant import Int8Linear
from loom.models.quant_method import get_quant_method
from loom.models.tensor_parallel import RowParallelOutput
from loom.models.w4a8 import W4A8Linear

pytestmark = pytest.mark.skipif(not cpu_kernels_available(),
                                reason=f"CPU kernels unavailable: {kernel_status()}")
each_variant = pytest.mark.usefixtures("each_kernel_variant")

# How the experts are prepared: as the float32 mode, int8 ("int8", kind 1), w8a8 (kind 2),
# and w4a8 from GGUF blocks (kind 3): K-quants (Q4_K gate/up, Q6_K down, as Q4_K_M files
# store experts) and blocks of 32 (Q8_0).
MODES = ["float32", "int8", "w8a8", "w4a8-kquants", "w4a8-q8_0"]
HIDDEN, INTER = 256, 256  # whole K-quant super-blocks


def _w4a8_experts(moe: SparseMoE, gate_type: int, down_type: int, seed: int) -> None:
    """Each expert's projections as W4A8Linear from random file blocks."""
    rng = np.random.default_rng(seed)
    h, i = moe.hidden_size, moe.intermediate_size

    def packed(type_id: int, rows: int, cols: int) -> torch.Tensor:
        raw = torch.from_numpy(random_blocks(rng, rows, cols, type_id))
        return w4a8_pack(raw, type_id, rows, cols)

    for expert in moe.experts:
        expert.fuse()
        expert.gate_up_proj = W4A8Linear(
            h, [(gate_type, i), (gate_type, i)], expert.gate_up_proj.bias,
            packed=[packed(gate_type, i, h), packed(gate_type, i, h)])
        expert.down_proj = W4A8Linear(i, [(down_type, h)], expert.down_proj.bias,
                                      packed=[packed(down_type, h, i)])


def make_moe(mode: str, num_experts: int = 8, top_k: int = 2, renormalize: bool = True,
             activation: str = "silu", hidden: int = HIDDEN, inter: int = INTER,
             seed: int = 0, router: Callable[[torch.Tensor], None] | None = None,
             gpt_oss: bool = False) -> SparseMoE:
    """A SparseMoE of random weights prepared as `mode` prepares experts; `router` edits the
    router's weight [E, H] in place (None: random, scaled so that margins decide the top
    k). `gpt_oss`: gpt-oss's block (top-k logits then their softmax, a router bias, biased
    experts gated by the clamped SwiGLU; `activation` ignored)."""
    torch.manual_seed(seed)
    if gpt_oss:
        moe = SparseMoE(hidden, inter, num_experts, top_k, True, ClampedSwiGLU(1.702, 7.0),
                        scoring="topk_softmax", router_bias=True, expert_bias=True)
    else:
        moe = SparseMoE(hidden, inter, num_experts, top_k, renormalize, activation)
    for expert in moe.experts:
        for proj in (expert.gate_proj, expert.up_proj, expert.down_proj):
            # gpt-oss's gate/up larger: the clamp at 7 bites on some values
            std = proj.in_features ** -0.5 * (6.0 if gpt_oss and proj is not
                                              expert.down_proj else 1.0)
            torch.nn.init.normal_(proj.weight, std=std)
            if proj.bias is not None:
                torch.nn.init.normal_(proj.bias, std=0.5)
    torch.nn.init.normal_(moe.gate.weight, std=hidden ** -0.5)
    if moe.gate.bias is not None:
        torch.nn.init.normal_(moe.gate.bias, std=0.5)
    if router is not None:
        with torch.no_grad():
            router(moe.gate.weight)
    moe.requires_grad_(False)
    if mode == "float32":
        for expert in moe.experts:
            expert.fuse()
    elif mode in ("int8", "w8a8"):
        get_quant_method(mode).prepare_layer(moe)
    elif mode == "w4a8-kquants":
        _w4a8_experts(moe, Q4_K, Q6_K, seed)
    elif mode == "w4a8-q8_0":
        _w4a8_experts(moe, Q8_0, Q8_0, seed)
    else:
        raise ValueError(mode)
    return moe


def kernel_of(moe: SparseMoE) -> MoEKernel:
    kernel, status = MoEKernel.build(moe)
    assert kernel is not None, status
    return kernel


def _one_layer(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A linear layer on rows x through its single-layer reference: the plain-C oracles of
    w8a8 and w4a8, the weight-only int8 and float32 kernels (one code path per row)."""
    if isinstance(layer, W4A8Linear):
        return linear_w4a8(x, layer.segments(), layer.bias, reference=True)
    if isinstance(layer, Int8Linear) and layer.quantize_activations:
        return linear_w8a8_reference(x, layer.row_major_int8(), layer.scales_f32, layer.bias)
    if isinstance(layer, Int8Linear):
        return linear_w8(x, layer.weight_q, layer.scales_f32, layer.bias)
    return linear_f32(x, layer.weight, layer.bias)


def oracle(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The block composed one (token, slot) at a time: C routing of the float32 router's
    logits, the chosen expert's gate_up on that one row, the C activation, down, and the
    slot-order sum in torch (multiplies, then adds: no FMA, as the C build)."""
    weights, experts = moe_route(linear_f32(x, moe.gate.weight, moe.gate.bias), moe.top_k,
                                 moe.renormalize, moe.scoring)
    activation = moe.activation
    if isinstance(activation, ClampedSwiGLU):
        activation = (activation.alpha, activation.limit)
    slots = torch.empty(x.shape[0], moe.top_k, moe.hidden_size)
    for t in range(x.shape[0]):
        for s in range(moe.top_k):
            expert = moe.experts[int(experts[t, s])]
            act = gated_act(_one_layer(expert.gate_up_proj, x[t:t + 1]), activation)
            slots[t, s] = _one_layer(expert.down_proj, act)[0]
    return combine_slots(slots, weights)


def _tokens(count: int, hidden: int = HIDDEN, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, hidden, generator=torch.Generator().manual_seed(seed))


# ---- routing ----

@each_variant
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("num_experts", "top_k"), [(16, 1), (16, 3), (128, 8), (6, 6)])
def test_route_equals_route_topk(num_experts: int, top_k: int, renormalize: bool) -> None:
    logits = torch.randn(37, num_experts, generator=torch.Generator().manual_seed(top_k)) * 3
    weights, experts = moe_route(logits, top_k, renormalize)
    want_weights, want_experts = route_topk(logits, top_k, renormalize)
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=0)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(37), atol=1e-6, rtol=0)


@each_variant
def test_route_ties_go_to_the_lower_expert() -> None:
    logits = torch.tensor([
        [0.0, 0.0, 0.0, 0.0, 0.0],  # all equal: the first k
        [1.0, 3.0, 3.0, 0.0, 3.0],  # three equal maxima
        [2.0, -1.0, 2.0, 2.0, 5.0],  # a maximum, then three equal
        [-4.0, -4.0, -9.0, -4.0, -4.0],
    ])
    weights, experts = moe_route(logits, 3, True)
    assert experts.tolist() == [[0, 1, 2], [1, 2, 4], [4, 0, 2], [0, 1, 3]]
    want_weights, want_experts = route_topk(logits, 3, True)
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=0)
    # k = E: every expert, in probability order.
    _, every = moe_route(logits, 5, False)
    assert every.tolist()[1] == [1, 2, 4, 0, 3]
    assert torch.equal(every, route_topk(logits, 5, False)[1])


# ---- the block ----

@each_variant
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize(("hidden", "inter", "num_experts", "top_k", "renormalize"), [
    (HIDDEN, INTER, 8, 2, True),
    (36, 20, 5, 5, False),  # every expert a token (k = E); widths off the 8 lanes and 4 rows
    (64, 96, 16, 4, False),
])
def test_float32_block_equals_the_expert_modules(hidden: int, inter: int, num_experts: int,
                                                 top_k: int, renormalize: bool,
                                                 activation: str) -> None:
    moe = make_moe("float32", num_experts, top_k, renormalize, activation, hidden, inter)
    x = _tokens(11, hidden)
    got = kernel_of(moe)(x)
    torch.testing.assert_close(got, moe.forward_modules(x), atol=2e-6, rtol=1e-5)
    # The module itself runs the kernel on the CPU.
    assert torch.equal(moe(x), got) and moe._kernel_status == "ok"
    # Row by row the same arithmetic as the single-layer kernels: the same bits.
    assert torch.equal(got, oracle(moe, x))


@each_variant
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_block_equals_the_row_by_row_oracle(mode: str, renormalize: bool) -> None:
    moe = make_moe(mode, renormalize=renormalize, activation="silu")
    x = _tokens(9)
    got = kernel_of(moe)(x)
    assert torch.equal(got, oracle(moe, x))
    if mode != "float32":  # the torch modules' arithmetic: the same model to rounding
        ref = moe.forward_modules(x)
        assert (got - ref).abs().max() <= 0.02 * ref.abs().max()


@each_variant
@pytest.mark.parametrize("mode", ["w8a8", "w4a8-kquants"])
def test_gelu_block_equals_the_oracle(mode: str) -> None:
    moe = make_moe(mode, activation="gelu_pytorch_tanh", top_k=3, seed=4)
    x = _tokens(6, seed=5)
    assert torch.equal(kernel_of(moe)(x), oracle(moe, x))


@each_variant
@pytest.mark.parametrize("mode", MODES)
def test_gpt_oss_block_equals_the_oracle_and_the_modules(mode: str) -> None:
    """gpt-oss's routing (the top k logits of a biased router, then their softmax), biased
    experts and the clamped SwiGLU: the C block equals the row-by-row oracle bit for bit and
    the torch modules to rounding (float32: to float error)."""
    moe = make_moe(mode, num_experts=6, top_k=3, gpt_oss=True, seed=6)
    x = _tokens(7, seed=8) * 2
    got = kernel_of(moe)(x)
    assert torch.equal(got, oracle(moe, x))
    ref = moe.forward_modules(x)
    if mode == "float32":
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    else:
        assert (got - ref).abs().max() <= 0.02 * ref.abs().max()
    if not mode.startswith("w4a8"):  # (w4a8's experts are random file blocks instead)
        pre = torch.cat([_one_layer(e.gate_up_proj, x) for e in moe.experts])
        assert (pre[:, :INTER] > 7).any() and (pre[:, INTER:].abs() > 7).any()  # clamped


def test_topk_softmax_routing_takes_the_top_logits_then_their_softmax() -> None:
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 1.0], [3.0, 0.0, 0.0, 0.0, 0.0]])
    weights, experts = moe_route(logits, 3, False, "topk_softmax")
    assert experts.tolist() == [[1, 2, 4], [0, 1, 2]]  # ties to the lower index
    torch.testing.assert_close(weights, logits.gather(1, experts).softmax(-1))
    with pytest.raises(ValueError, match="scoring"):
        moe_route(logits, 2, False, "sigmoid")


def _dominant_expert(weight: torch.Tensor) -> None:
    """Expert 5 reads feature 0 with a large weight (the tokens' feature 0 is large and
    positive): every token's slot 0 is expert 5, the other slots vary."""
    weight[5, 0] = 10.0


def _flat_router(weight: torch.Tensor) -> None:
    """Every logit 0: every token ties across all experts and takes the first k."""
    weight.zero_()


# (experts, top_k, tokens, router): each token's output must not depend on the batch when
# tokens spread over the experts, when all pick the same one, when most experts get no
# token, when every expert gets some, and when every choice is a tie.
SCENARIOS = {
    "spread": (8, 2, 13, None),
    "one-expert-for-all": (8, 2, 10, _dominant_expert),
    "most-experts-idle": (32, 2, 3, None),
    "every-expert-used": (4, 3, 24, None),
    "all-ties": (8, 3, 7, _flat_router),
}


@each_variant
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_tokens_output_does_not_depend_on_its_batch(mode: str, scenario: str) -> None:
    num_experts, top_k, count, router = SCENARIOS[scenario]
    moe = make_moe(mode, num_experts, top_k, router=router, seed=len(scenario))
    x = _tokens(count, seed=count)
    if router is _dominant_expert:
        x[:, 0] = x[:, 0].abs() + 4.0
    _, experts = moe_route(linear_f32(x, moe.gate.weight, None), top_k, True)
    used = set(experts.flatten().tolist())
    if scenario == "one-expert-for-all":
        assert (experts[:, 0] == 5).all() and len(used) > top_k
    elif scenario == "most-experts-idle":
        assert len(used) <= 2 * top_k * count < num_experts
    elif scenario == "every-expert-used":
        assert used == set(range(num_experts))
    elif scenario == "all-ties":
        assert (experts == torch.arange(top_k)).all()
    kernel = kernel_of(moe)
    batch = kernel(x)
    for t in range(count):
        assert torch.equal(kernel(x[t:t + 1]), batch[t:t + 1]), t
    order = torch.randperm(count, generator=torch.Generator().manual_seed(3))
    assert torch.equal(kernel(x[order]), batch[order])
    assert torch.equal(kernel(torch.cat([x, x[:2]]))[:count], batch)
    assert torch.equal(batch, oracle(moe, x))


@pytest.mark.skipif(len(runnable_variants()) < 2, reason="one kernel variant on this CPU")
@pytest.mark.parametrize("mode", ["w8a8", "w4a8-kquants", "float32"])
def test_every_kernel_variant_gives_the_same_bits(mode: str) -> None:
    moe = make_moe(mode, top_k=3, seed=9)
    x = _tokens(10, seed=9)
    outputs = {}
    for variant in runnable_variants():
        with use_variant(variant):
            outputs[variant] = kernel_of(moe)(x)
    first = next(iter(outputs.values()))
    assert all(torch.equal(first, y) for y in outputs.values()), list(outputs)


@pytest.mark.parametrize("mode", ["w8a8", "w4a8-kquants"])
def test_a_tensor_parallel_ranks_slice_of_the_experts(mode: str) -> None:
    """A rank's experts hold a slice of the block's intermediate_size (their partial sums
    are all-reduced after the block): the kernel takes the experts' own width."""
    moe = make_moe(mode, seed=6)
    moe.intermediate_size = 4 * INTER  # the whole block's width, split over 4 ranks
    x = _tokens(5, seed=6)
    assert torch.equal(kernel_of(moe)(x), oracle(moe, x))


def test_blocks_without_a_kernel_form_keep_the_modules() -> None:
    moe = make_moe("w8a8", seed=2)
    moe.experts[3].down_proj = RowParallelOutput(moe.experts[3].down_proj, group=None)
    kernel, status = MoEKernel.build(moe)
    assert kernel is None and "RowParallelOutput" in status
    moe = make_moe("float32", seed=2)
    moe.gate.weight.data = moe.gate.weight.data.to(torch.bfloat16)
    kernel, status = MoEKernel.build(moe)
    assert kernel is None and "float32" in status
    moe = make_moe("float32", seed=2)
    moe.requires_grad_(True)
    assert MoEKernel.build(moe) == (None, "parameters require gradients "
                                          "(call requires_grad_(False))")


# ---- the fused decoder ----

def test_fused_decoder_runs_the_experts_batch_invariant(tmp_path) -> None:
    """A tiny Qwen3-MoE (layer 0 experts, layer 1 dense) in w8a8 with float16 KV caches:
    every step runs in the fused decoder, and each prompt's greedy tokens and logprobs are
    the same alone and in a batch, and near the module path's (the same block through
    MoEKernel, the other layers through the modules)."""
    build_tiny_model("qwen3_moe", tmp_path)
    engine = make_engine(tmp_path, quantization="w8a8", kv_cache_dtype="float16")
    model = engine.runner.model
    assert SparseMoE is type(model.model.layers[0].mlp)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    prompts = [[5, 9, 17, 3, 22, 8, 1], [40, 41, 2], [7] * 12, [3, 1, 4, 1, 5, 9, 2, 6]]

    def generate(tag: str, batch: list[list[int]]) -> list[tuple[list[int], list]]:
        for i, ids in enumerate(batch):
            engine.add_request(f"{tag}{i}", ids, params)
        outs = run_to_completion(engine)
        return [(list(outs[f"{tag}{i}"].outputs[0].token_ids),
                 list(outs[f"{tag}{i}"].outputs[0].logprobs)) for i in range(len(batch))]

    alone = [generate(f"alone{i}-", [ids])[0] for i, ids in enumerate(prompts)]
    assert model.fused_decode_status == "ok"
    assert model.fused_decoder is not None and model.fused_decoder.max_tokens is None
    assert generate("batch", prompts) == alone
    model.use_fused_decode = False
    try:
        modules = generate("modules", prompts)
    finally:
        model.use_fused_decode = True
    assert model.model.layers[0].mlp._kernel_status == "ok"
    for (tokens, logprobs), (m_tokens, m_logprobs) in zip(alone, modules, strict=True):
        assert tokens == m_tokens
        for got, want in zip(logprobs, m_logprobs, strict=True):
            for token, value in want.items():
                assert abs(got[token].logprob - value.logprob) < 0.05
