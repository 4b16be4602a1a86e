"""Mixtures of experts (Qwen3-MoE, Mixtral, OLMoE): the routing rule, the block against a naive
per-token loop, tiny GGUFs of expert blocks in exact mode against transformers on the same
dequantised weights, and the files Loom must refuse.

The HF-form tiny models ("qwen3_moe", "mixtral", "olmoe" in TINY_ARCHS) are compared with
transformers by the per-architecture engine tests (tests/engine/test_llm_engine.py and
others)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine.helpers import make_engine, run_to_completion
from tiny_gguf import (
    EXPERTS,
    EXPERTS_USED,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    MOE_BLOCKS32,
    MOE_FFN,
    MOE_KQUANTS,
    VOCAB,
    write_tiny_moe,
)
from tiny_reference import build_tiny_tokenizer

from loom import SamplingParams
from loom.errors import InvalidModelError, UnsupportedModelError
from loom.loader.gguf_reader import GGUFFile
from loom.models.moe import SparseMoE, route_topk

PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 128, 9, 200, 33, 77, 1 + 2]


def test_route_topk_orders_by_probability_and_breaks_ties_by_index():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, 0.0, 3.0, 3.0]])
    weights, experts = route_topk(logits, 2, renormalize=False)
    assert experts.tolist() == [[1, 2], [0, 1], [2, 3]]
    probs = torch.softmax(logits, -1)
    assert torch.equal(weights, probs.gather(1, experts))
    renormalised, same = route_topk(logits, 2, renormalize=True)
    assert torch.equal(same, experts)
    assert torch.allclose(renormalised.sum(-1), torch.ones(3))
    _, all_experts = route_topk(logits, 4, renormalize=True)
    assert sorted(all_experts[0].tolist()) == [0, 1, 2, 3]


def _random_moe(seed: int, experts: int = 6, top_k: int = 2, renormalize: bool = True,
                router_scale: float = 1.0) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(32, 16, experts, top_k, renormalize, "silu")
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        moe.gate.weight.mul_(router_scale)
    return moe.requires_grad_(False)


def _per_token(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The block one token at a time, the plainest reading of the rule."""
    rows = []
    for row in x:
        weights, experts = moe.route(row[None])
        rows.append(sum(float(w) * moe.experts[int(e)](row[None])[0]
                        for w, e in zip(weights[0], experts[0], strict=True)))
    return torch.stack(rows)


@pytest.mark.parametrize(("case", "router_scale", "top_k"), [
    ("spread", 1.0, 2),
    ("one expert takes every token", 0.0, 2),  # all logits equal: experts 0 and 1, ties
    ("every expert, every token", 1.0, 6),
])
def test_block_equals_a_per_token_loop(case, router_scale, top_k):
    moe = _random_moe(0, top_k=top_k, router_scale=router_scale)
    x = torch.randn(11, 32)
    want = _per_token(moe, x)
    assert torch.allclose(moe.forward_modules(x), want, atol=1e-5)
    assert torch.allclose(moe(x), want, atol=1e-5)  # the C block where the kernels run
    if router_scale == 0.0:
        assert moe.route(x)[1].unique().tolist() == [0, 1]


def test_experts_no_token_chose_are_never_called():
    moe = _random_moe(1, experts=8)
    x = torch.randn(1, 32)
    chosen = set(moe.route(x)[1][0].tolist())
    called: set[int] = set()
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda *_, e=e: called.add(e))
    moe.forward_modules(x)
    assert called == chosen and len(chosen) == 2


# ---- GGUF files of expert blocks --------------------------------------------------------


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order for Llama-architecture files (as transformers does)."""
    rows = w.shape[0]
    return (w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def _reference(path: Path, arch: str):
    """transformers' model of the file's weights, dequantised by `gguf`'s own numpy code (not
    Loom's): Qwen3MoeForCausalLM for "qwen3moe", OlmoeForCausalLM for "olmoe",
    MixtralForCausalLM for "llama"."""
    import gguf
    import transformers as tf

    reader = gguf.GGUFReader(str(path))
    values = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(
        [int(d) for d in reversed(t.shape)]).astype(np.float32) for t in reader.tensors}
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-6,
                  max_position_embeddings=256, tie_word_embeddings=True,
                  num_experts_per_tok=EXPERTS_USED, rope_theta=10000.0)
    if arch == "qwen3moe":
        config = tf.Qwen3MoeConfig(**common, head_dim=HIDDEN // HEADS, intermediate_size=MOE_FFN,
                                   moe_intermediate_size=MOE_FFN, num_experts=EXPERTS,
                                   norm_topk_prob=True)
    elif arch == "olmoe":
        config = tf.OlmoeConfig(**common, intermediate_size=MOE_FFN, num_experts=EXPERTS,
                                norm_topk_prob=False)
    else:
        config = tf.MixtralConfig(**common, intermediate_size=MOE_FFN, num_local_experts=EXPERTS,
                                  sliding_window=None)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {"model.embed_tokens.weight": values["token_embd.weight"],
             "model.norm.weight": values["output_norm.weight"]}
    for i in range(LAYERS):
        v = {k.split(".", 2)[2]: a for k, a in values.items() if k.startswith(f"blk.{i}.")}
        p = f"model.layers.{i}."
        q, k = v["attn_q.weight"], v["attn_k.weight"]
        if arch == "llama":
            q, k = _unpermute(q, HEADS), _unpermute(k, KV_HEADS)
        state.update({
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v["attn_v.weight"],
            p + "self_attn.o_proj.weight": v["attn_output.weight"],
            p + "input_layernorm.weight": v["attn_norm.weight"],
            p + "post_attention_layernorm.weight": v["ffn_norm.weight"],
            p + "mlp.gate.weight": v["ffn_gate_inp.weight"],
            p + "mlp.experts.gate_up_proj": np.concatenate(
                [v["ffn_gate_exps.weight"], v["ffn_up_exps.weight"]], axis=1),
            p + "mlp.experts.down_proj": v["ffn_down_exps.weight"],
        })
        if arch in ("qwen3moe", "olmoe"):
            state[p + "self_attn.q_norm.weight"] = v["attn_q_norm.weight"]
            state[p + "self_attn.k_norm.weight"] = v["attn_k_norm.weight"]
    missing, unexpected = model.load_state_dict(
        {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in state.items()},
        strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(arch, types) -> a folder holding one tiny MoE GGUF and the tiny tokenizer."""
    root = tmp_path_factory.mktemp("moe-gguf")
    made = {}
    for arch in ("qwen3moe", "olmoe", "llama"):
        for kind, types in (("kquants", MOE_KQUANTS), ("blocks32", MOE_BLOCKS32)):
            folder = root / f"{arch}-{kind}"
            build_tiny_tokenizer(folder)
            write_tiny_moe(folder / "moe.gguf", arch, types)
            made[arch, kind] = folder
    return made


def _last_logprobs(folder: Path, **engine_args) -> tuple[int, dict[int, float]]:
    engine = make_engine(folder, **engine_args)
    engine.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))
    out = run_to_completion(engine)["a"].outputs[0]
    assert engine.kv_pool_all_free
    return out.token_ids[0], out.logprobs[0]


@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe", "llama"])
@pytest.mark.parametrize("kind", ["kquants", "blocks32"])
def test_gguf_experts_in_exact_mode_equal_transformers(moe_files, arch, kind):
    """Exact mode dequantises the file's expert blocks: the same model as transformers on
    `gguf`'s dequantisation of the same file (the llama file is Mixtral's layout)."""
    folder = moe_files[arch, kind]
    reference = _reference(folder / "moe.gguf", arch)
    with torch.no_grad():
        ref = torch.log_softmax(reference(torch.tensor([PROMPT])).logits[0, -1].float(), -1)
    token, logprobs = _last_logprobs(folder, quantization=None)
    assert token == int(ref.argmax())
    for t, lp in logprobs.items():
        assert lp == pytest.approx(float(ref[t]), abs=2e-4)


@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe", "llama"])
def test_gguf_default_mode_is_close_to_exact(moe_files, arch):
    """w4a8 (the default for a quantised GGUF) computes the experts from the file's blocks
    with int8 activations: the same model to activation rounding."""
    folder = moe_files[arch, "kquants"]
    exact = _last_logprobs(folder, quantization=None)[1]
    default = _last_logprobs(folder)[1]
    shared = set(exact) & set(default)
    assert len(shared) >= 3
    for t in shared:
        assert default[t] == pytest.approx(exact[t], abs=0.05)


def test_experts_stored_one_tensor_each_load_as_the_3d_file(tmp_path):
    """Older converters wrote `blk.N.ffn_gate.E.weight` per expert: the same model."""
    for split in (False, True):
        folder = tmp_path / f"split-{split}"
        build_tiny_tokenizer(folder)
        write_tiny_moe(folder / "moe.gguf", "llama", MOE_KQUANTS, split_experts=split)
    merged = _last_logprobs(tmp_path / "split-False", quantization=None)
    split = _last_logprobs(tmp_path / "split-True", quantization=None)
    assert merged == split


def test_wrong_expert_count_names_the_tensor(tmp_path):
    build_tiny_tokenizer(tmp_path)
    write_tiny_moe(tmp_path / "moe.gguf", "qwen3moe", MOE_KQUANTS, expert_count=EXPERTS + 2)
    with pytest.raises(InvalidModelError, match=r"'blk\.0\.ffn_gate_inp\.weight' has shape "
                                                r"\(4, 256\): the router of the file's"
                                                r" expert_count of 6 experts"):
        make_engine(tmp_path, quantization=None)


def test_truncated_expert_tensor_names_it(tmp_path):
    build_tiny_tokenizer(tmp_path)
    path = write_tiny_moe(tmp_path / "whole.gguf", "qwen3moe", MOE_KQUANTS)
    last = max(GGUFFile(path).tensors, key=lambda t: t.offset)
    experts = [t for t in GGUFFile(path).tensors if "exps" in t.name]
    cut_in = max(experts, key=lambda t: t.offset)  # the last expert tensor of the file
    assert cut_in.offset + cut_in.nbytes <= last.offset + last.nbytes
    data = path.read_bytes()[:cut_in.offset + cut_in.nbytes // 2]
    path.unlink()
    (tmp_path / "cut.gguf").write_bytes(data)
    with pytest.raises(InvalidModelError, match=rf"tensor '{cut_in.name}' runs past the end"):
        make_engine(tmp_path, quantization=None)


def test_default_mode_experts_come_from_the_files_blocks_and_the_cache_rebuilds_them(
    moe_files, tmp_path, monkeypatch,
):
    """In w4a8 every expert's stacked gate/up and its down are the file's Q4_K / Q6_K blocks
    (no second quantisation), the router stays float32, the fused decoder runs the MoE
    layers, and a load from the prepared cache computes the same bits."""
    from loom.models.w4a8 import W4A8Linear
    from loom.runner import build_model
    from loom.runner.prepared import prepared_path, wait_for_prepared_writes

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    folder = moe_files["qwen3moe", "kquants"]
    _, model = build_model(folder, quantization="w4a8")
    moe = model.model.layers[1].mlp
    assert isinstance(moe, SparseMoE) and len(moe.experts) == EXPERTS
    for expert in moe.experts:
        assert isinstance(expert.gate_up_proj, W4A8Linear)
        assert expert.gate_up_proj.types == [MOE_KQUANTS["gate"], MOE_KQUANTS["up"]]
        assert expert.down_proj.types == [MOE_KQUANTS["down"]]
    assert moe.gate.weight.dtype == torch.float32
    _, exact = build_model(folder, quantization=None)
    third = exact.model.layers[1].mlp.experts[3]
    assert torch.equal(moe.experts[3].gate_up_proj.dequantized_weight(),
                       third.gate_up_proj.weight)
    x = torch.randn(5, HIDDEN)
    first = moe(x)
    wait_for_prepared_writes(prepared_path(folder / "moe.gguf", torch.float32, "w4a8",
                                           "packed", None))
    _, warm = build_model(folder, quantization="w4a8")
    assert torch.equal(warm.model.layers[1].mlp(x), first)
    engine = make_engine(folder)  # the default mode, from the prepared cache
    engine.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=3))
    run_to_completion(engine)
    assert engine.config.quantization == "w4a8"
    assert engine.runner.model.fused_decode_status == "ok"


def test_olmoe_with_clamped_qkv_is_refused(tiny_models, tmp_path):
    """OLMoE's `clip_qkv` (q, k and v clamped) is not computed: a model that sets it is
    refused by name rather than run without it."""
    import json
    import shutil

    folder = shutil.copytree(tiny_models["olmoe"][0], tmp_path / "olmoe")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "clip_qkv": 8.0}))
    with pytest.raises(UnsupportedModelError, match=r"OLMoE with clip_qkv=8\.0"):
        make_engine(folder, quantization=None)


def test_a_copy_of_a_block_that_ran_builds_its_own_kernel():
    """`copy.deepcopy` of a block whose C form was built (its descriptor points into the
    block's own tensors) gives a block that computes the same, and, once its weights change,
    computes from its own weights, not the original's."""
    import copy

    moe = _random_moe(2)
    x = torch.randn(5, 32)
    want = moe(x)
    twin = copy.deepcopy(moe)
    assert torch.equal(twin(x), want)
    with torch.no_grad():
        for p in twin.experts.parameters():
            p.mul_(2.0)
    twin.invalidate_kernel()
    assert not torch.allclose(twin(x), want)
    assert torch.equal(moe(x), want)
