"""gpt-oss from its GGUF, as llama.cpp's converter lays it out (MXFP4 experts [experts, out,
in] with float32 biases [experts, out], attention sinks, biased attention and router, YaRN
and the sliding / full layer pattern in metadata or implied by the architecture): exact mode
against transformers on the file's own weights dequantised by `gguf`, for every type the
dense matrices come in; the default mode (w4a8) computing the experts from their MXFP4
blocks; a file whose expert count is wrong.

The HF float form of the same tiny model is tests/models/test_gpt_oss.py's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine.helpers import make_engine, run_to_completion
from gguf import GGMLQuantizationType
from tiny_gguf import BF16, F16, F32, MXFP4, Q8_0, write_tiny_gpt_oss
from tiny_models import PARITY_ATOL, chunk
from tiny_reference import hf_greedy, tiny_gpt_oss, tiny_gpt_oss_config

from loom import LLM, SamplingParams
from loom.errors import InvalidModelError
from loom.kernels import cpu_kernels_available
from loom.loader.gguf_file import _pieces, gguf_to_hf_config, gguf_to_hf_name
from loom.loader.gguf_reader import GGUFFile, GGUFTensorInfo
from loom.models.quant import Int8Linear
from loom.models.w4a8 import W4A8Linear
from loom.runner import ModelRunner, build_model

# The types the dense matrices (q/k/v/o, the embedding, the output) of gpt-oss files take.
DENSE = {"q8_0": Q8_0, "f16": F16, "bf16": BF16, "f32": F32}
PROMPT = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(1)).tolist()
NEW_TOKENS = 12
FILE = "gpt-oss.gguf"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Dense type name -> a folder holding the tiny gpt-oss's GGUF and the tiny tokenizer."""
    root = tmp_path_factory.mktemp("gpt-oss-gguf")
    model = tiny_gpt_oss()
    made = {}
    for name, type_id in DENSE.items():
        write_tiny_gpt_oss(root / name / FILE, model, type_id)
        made[name] = root / name
    return made


def _reference(path: Path):
    """transformers' GptOssForCausalLM of the file's weights, dequantised by `gguf`'s own
    numpy code (not Loom's): each layer's gate and up interleaved back into HF's fused
    gate_up_proj [experts, in, 2 x out] (gate the even outputs, up the odd), down
    transposed to [experts, in, out]."""
    import gguf
    import transformers as tf

    reader = gguf.GGUFReader(str(path))
    v = {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
         .reshape([int(d) for d in reversed(t.shape)]) for t in reader.tensors}
    config = tiny_gpt_oss_config()
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {"model.embed_tokens.weight": v["token_embd.weight"],
             "model.norm.weight": v["output_norm.weight"], "lm_head.weight": v["output.weight"]}
    for i in range(config.num_hidden_layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        gate, up = v[b + "ffn_gate_exps.weight"], v[b + "ffn_up_exps.weight"]  # [E, out, in]
        gate_up = np.empty((gate.shape[0], gate.shape[2], 2 * gate.shape[1]), np.float32)
        gate_up[:, :, 0::2], gate_up[:, :, 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
        gate_up_bias = np.empty((gate.shape[0], 2 * gate.shape[1]), np.float32)
        gate_up_bias[:, 0::2] = v[b + "ffn_gate_exps.bias"]
        gate_up_bias[:, 1::2] = v[b + "ffn_up_exps.bias"]
        state.update({
            p + "input_layernorm.weight": v[b + "attn_norm.weight"],
            p + "post_attention_layernorm.weight": v[b + "post_attention_norm.weight"],
            p + "self_attn.sinks": v[b + "attn_sinks.weight"],
            p + "mlp.router.weight": v[b + "ffn_gate_inp.weight"],
            p + "mlp.router.bias": v[b + "ffn_gate_inp.bias"],
            p + "mlp.experts.gate_up_proj": gate_up,
            p + "mlp.experts.gate_up_proj_bias": gate_up_bias,
            p + "mlp.experts.down_proj": v[b + "ffn_down_exps.weight"].transpose(0, 2, 1),
            p + "mlp.experts.down_proj_bias": v[b + "ffn_down_exps.bias"],
        })
        for kind, proj in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                           ("attn_output", "o_proj")):
            state[f"{p}self_attn.{proj}.weight"] = v[f"{b}{kind}.weight"]
            state[f"{p}self_attn.{proj}.bias"] = v[f"{b}{kind}.bias"]
    model.load_state_dict({name: torch.from_numpy(np.array(a, dtype=np.float32))
                           for name, a in state.items()}, strict=True)
    return model


def _int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """`x` with every block of 32 along its last dimension rounded to int8 steps of its
    largest magnitude / 127 (half to even): the activations the w4a8 kernel multiplies."""
    blocks = x.reshape(-1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    step = torch.where(step == 0, torch.ones_like(step), step)
    return (torch.round(blocks / step) * step).reshape(x.shape)


def _with_rounded_activations(reference, monkeypatch) -> None:
    """Make transformers' model compute as w4a8 does: the input of every matrix (q/k/v/o,
    the experts' gate/up and down, the output projection; not the router, which stays
    float) rounded by `_int8_rounded`, the weights the file's values."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    experts = modeling_gpt_oss.GptOssExperts
    gate = experts._apply_gate  # its output is the down projection's input
    monkeypatch.setattr(experts, "_apply_gate", lambda self, x: _int8_rounded(gate(self, x)))
    for name, module in reference.named_modules():
        if isinstance(module, (torch.nn.Linear, experts)) and "router" not in name:
            module.register_forward_pre_hook(
                lambda _, args: (_int8_rounded(args[0]), *args[1:]))


def _logits(folder: Path, tokens: list[int], quantization: str | None):
    """(logits, positions, model): Loom's logits at `positions` of `tokens`, the last of
    three prefill chunks (crossing blocks and windows) and every decode after the prompt,
    one token a step (the fused decoder's path)."""
    config, model = build_model(folder, quantization=quantization)
    runner = ModelRunner(config, model, "cpu", torch.float32, 64, 4)
    total, rows = len(tokens), {}
    for lo, hi in ((0, 11), (11, 19), (19, len(PROMPT))):
        rows[hi - 1] = runner.execute([chunk("a", tokens[lo:hi], lo, total, seq=0)])[0]
    for pos in range(len(PROMPT), total):
        rows[pos] = runner.execute([chunk("a", [tokens[pos]], pos, total, seq=0)])[0]
    return torch.stack([rows[pos] for pos in sorted(rows)]), sorted(rows), model


def test_config_and_names_from_the_file(files):
    """The metadata becomes transformers' GptOssConfig of the model the file was written
    from (YaRN, its window and layer pattern, the experts' width); llama.cpp's names
    become HF's (sinks without a `.weight`, the pre-feed-forward norm, expert biases)."""
    config = gguf_to_hf_config(GGUFFile(files["q8_0"] / FILE))
    want = tiny_gpt_oss_config()
    assert config["architectures"] == ["GptOssForCausalLM"]
    assert config["layer_types"] == want.layer_types
    assert config["rope_scaling"] == {k: v for k, v in want.rope_parameters.items()
                                      if k != "rope_theta"}
    assert config["rope_theta"] == want.rope_parameters["rope_theta"]
    for key in ("intermediate_size", "sliding_window", "head_dim", "num_experts_per_tok",
                "max_position_embeddings", "swiglu_limit"):
        assert config[key] == getattr(want, key), key
    assert config["num_experts"] == want.num_local_experts
    assert not config["tie_word_embeddings"]
    for gguf_name, hf_name in (
        ("blk.1.attn_sinks.weight", "model.layers.1.self_attn.sinks"),
        ("blk.1.post_attention_norm.weight", "model.layers.1.post_attention_layernorm.weight"),
        ("blk.1.ffn_gate_inp.bias", "model.layers.1.mlp.gate.bias"),
        ("blk.1.ffn_up_exps.bias", "model.layers.1.mlp.experts.{expert}.up_proj.bias"),
        ("blk.1.attn_output.bias", "model.layers.1.self_attn.o_proj.bias"),
    ):
        assert gguf_to_hf_name("gpt-oss", gguf_name) == hf_name


@pytest.mark.parametrize("dense", DENSE)
def test_exact_mode_equals_transformers_on_the_files_weights(files, dense):
    """Exact mode dequantises the MXFP4 experts and the dense matrices: every position's
    logits within PARITY_ATOL of transformers on `gguf`'s dequantisation of the same file,
    and the engine's greedy tokens are transformers'."""
    folder = files[dense]
    reference = _reference(folder / FILE)
    tokens = PROMPT + hf_greedy(reference, PROMPT, NEW_TOKENS)
    assert len(set(tokens[len(PROMPT):])) > NEW_TOKENS // 2  # not a degenerate repetition
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0].float()
    got, positions, model = _logits(folder, tokens, quantization=None)
    worst = float((got - want[positions]).abs().max())
    assert worst <= PARITY_ATOL, worst
    if cpu_kernels_available():
        assert model.fused_decode_status == "ok"
    engine = make_engine(folder, quantization=None, max_num_batched_tokens=12)
    engine.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert run_to_completion(engine)["a"].outputs[0].token_ids == tokens[len(PROMPT):]
    assert engine.kv_pool_all_free


def test_default_mode_computes_the_experts_from_their_mxfp4_blocks(files, tmp_path,
                                                                   monkeypatch):
    """`LLM(model=path)` on a quantised GGUF runs w4a8: every expert's stacked gate/up and
    its down are W4A8Linear of the file's MXFP4 blocks (the exact model's values, no second
    quantisation) carrying the expert's biases, and the fused decoder runs the decodes. Its
    logits are transformers' on the file's weights with each matrix's input rounded to int8
    as the kernel rounds it: exact mode's but for activation rounding."""
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    folder = files["q8_0"]
    llm = LLM(model=str(folder / FILE), num_kv_blocks=64, block_size=4)
    assert llm.engine.config.quantization == "w4a8"
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4
    if cpu_kernels_available():
        assert llm.engine.runner.model.fused_decode_status == "ok"
    _, default = build_model(folder, quantization="w4a8")
    _, exact = build_model(folder, quantization=None)
    for layer, exact_layer in zip(default.model.layers, exact.model.layers, strict=True):
        for expert, want in zip(layer.mlp.experts, exact_layer.mlp.experts, strict=True):
            for proj, types in (("gate_up_proj", [MXFP4, MXFP4]), ("down_proj", [MXFP4])):
                got, ref = getattr(expert, proj), getattr(want, proj)
                assert isinstance(got, W4A8Linear) and got.types == types
                assert torch.equal(got.dequantized_weight(), ref.weight)
                assert torch.equal(got.bias, ref.bias)
    tokens = PROMPT + [int(t) for t in out.outputs[0].token_ids]
    got, positions, _ = _logits(folder, tokens, quantization="w4a8")
    reference = _reference(folder / FILE)
    with torch.no_grad():
        exact = reference(torch.tensor([tokens])).logits[0, positions]
        _with_rounded_activations(reference, monkeypatch)
        rounded = reference(torch.tensor([tokens])).logits[0, positions]
    # Rounding moves the logits (by ~0.1 here); w4a8 is the rounded model to float noise
    # (measured 3e-6: a flipped rounding of one activation would show as ~1e-3).
    assert float((rounded - exact).abs().max()) > 0.02
    worst = float((got - rounded).abs().max())
    assert worst <= 1e-3, worst


@pytest.mark.parametrize("dense", DENSE)
def test_default_mode_runs_with_every_dense_type(files, dense, tmp_path, monkeypatch):
    """Whatever type q/k/v/o come in, the default mode is w4a8 (the experts make the file a
    quantised one): MXFP4 experts from their blocks, Q8_0 attention from its blocks too,
    float attention quantised to int8 (w8a8's layer), and the fused decoder runs."""
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    llm = LLM(model=str(files[dense] / FILE), num_kv_blocks=64, block_size=4)
    model = llm.engine.runner.model
    assert llm.engine.config.quantization == "w4a8"
    attention = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(attention, W4A8Linear if dense == "q8_0" else Int8Linear)
    assert isinstance(model.model.layers[0].mlp.experts[0].down_proj, W4A8Linear)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4
    if cpu_kernels_available():
        assert model.fused_decode_status == "ok"


def test_wrong_expert_count_names_the_tensor(tmp_path):
    """The header's expert count against the tensors': the first that disagrees is named
    (the router here); an expert bias is checked as [experts, rows]."""
    write_tiny_gpt_oss(tmp_path / FILE, tiny_gpt_oss(), expert_count=8)
    with pytest.raises(InvalidModelError, match=r"'blk\.0\.ffn_gate_inp\.weight' has shape "
                                                r"\(6, 64\): the router of the file's"
                                                r" expert_count of 8 experts"):
        make_engine(tmp_path, quantization=None)
    bias = GGUFTensorInfo("blk.2.ffn_up_exps.bias", (6, 32), GGMLQuantizationType.F32, 0)
    name = gguf_to_hf_name("gpt-oss", bias.name)
    assert [piece[:2] for piece in _pieces(bias, name, 6)] == [
        (f"model.layers.2.mlp.experts.{e}.up_proj.bias", e) for e in range(6)]
    with pytest.raises(InvalidModelError, match=r"'blk\.2\.ffn_up_exps\.bias' has shape "
                                                r"\(6, 32\): an expert tensor of the file's"
                                                r" expert_count of 8 experts must be \[8, rows\]"):
        _pieces(bias, name, 8)


@pytest.mark.parametrize("quantization", [None, "w4a8"])
def test_fused_gate_up_experts_load_as_the_split_ones(files, tmp_path, quantization):
    """A file whose experts' gate and up come fused (`ffn_gate_up_exps`, each expert's gate
    rows then its up rows, the bias the same) is the split file's model: the same expert
    weights and biases, and bit-identical logits in exact and default mode."""
    fused = tmp_path / "fused"
    write_tiny_gpt_oss(fused / FILE, tiny_gpt_oss(), fused_gate_up=True)
    names = {t.name for t in GGUFFile(fused / FILE).tensors}
    assert "blk.0.ffn_gate_up_exps.weight" in names and "blk.0.ffn_gate_exps.weight" not in names
    assert [piece[:3] for piece in _pieces(
        GGUFTensorInfo("blk.1.ffn_gate_up_exps.bias", (6, 64), GGMLQuantizationType.F32, 0),
        gguf_to_hf_name("gpt-oss", "blk.1.ffn_gate_up_exps.bias"), 6)][:2] == [
        ("model.layers.1.mlp.experts.0.gate_proj.bias", 0, slice(0, 32)),
        ("model.layers.1.mlp.experts.0.up_proj.bias", 0, slice(32, 64))]
    tokens = PROMPT + list(range(40, 40 + NEW_TOKENS))
    want, _, split_model = _logits(files["q8_0"], tokens, quantization)
    got, _, fused_model = _logits(fused, tokens, quantization)
    assert torch.equal(got, want)
    split_state, fused_state = split_model.state_dict(), fused_model.state_dict()
    assert split_state.keys() == fused_state.keys()
    for name, value in split_state.items():
        assert torch.equal(fused_state[name], value), name
