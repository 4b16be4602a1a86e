"""Tiny Llama-architecture GGUF files whose matrices are random blocks of the GGUF types
w4a8 computes (the K-quants and the blocks of 32), for tests of the default mode on
quantised files without a download."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 512
F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 1, 2, 3, 6, 7, 8, 12, 13, 14
BLOCK = {Q4_0: (18, 32), Q4_1: (20, 32), Q5_0: (22, 32), Q5_1: (24, 32), Q8_0: (34, 32),
         Q4_K: (144, 256), Q5_K: (176, 256), Q6_K: (210, 256)}
# The largest integer a type's d multiplies (|q - offset| or q), so that d = SPAN / it keeps
# the weights to a few hundredths.
_REACH = {Q4_0: 8, Q4_1: 15, Q5_0: 16, Q5_1: 31, Q8_0: 127}
SPAN = 0.04


def random_blocks(rng: np.random.Generator, rows: int, cols: int, type_id: int) -> np.ndarray:
    """Random blocks of a [rows, cols] tensor, scales small enough for weights of a few
    hundredths: uint8 [rows, bytes per row]."""
    size, values = BLOCK[type_id]
    count = rows * cols // values
    blocks = rng.integers(0, 256, size=(count, size), dtype=np.uint8)

    def f16(at: int, scales: np.ndarray) -> None:
        blocks[:, at:at + 2] = scales.astype(np.float16).view(np.uint8).reshape(count, 2)

    jitter = rng.random(count, dtype=np.float32) * 0.5 + 0.5
    if type_id in _REACH:
        f16(0, SPAN / _REACH[type_id] * jitter)
        if type_id in (Q4_1, Q5_1):  # m: the block's offset, about minus half the span
            f16(2, -SPAN / 2 * jitter)
        return blocks.reshape(rows, -1)
    if type_id == Q6_K:
        blocks[:, 192:208] &= 0x07  # small int8 sub-block scales
    else:
        blocks[:, 4:16] &= 0x0F  # small six-bit scales and mins
    span = 1.0 if type_id == Q4_K else 0.5  # Q5_K's and Q6_K's values reach 31 and 63
    for at in ((208,) if type_id == Q6_K else (0, 2)):
        f16(at, span * (rng.random(count, dtype=np.float32) * 2e-3 + 5e-4))
    return blocks.reshape(rows, -1)


def llama_writer(path: Path, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int,
                 context: int, arch: str = "llama", eps: float = 1e-5,
                 theta: float = 10000.0) -> Any:
    """A `gguf.GGUFWriter` at `path` with a Llama-like model's header fields (tensors to
    add; `arch` "qwen3moe" for Qwen3-MoE or "gpt-oss", whose own fields the caller adds)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_rope_freq_base(theta)
    return writer


def finish(writer: Any, path: Path, norm: np.ndarray | None = None) -> Path:
    """Add the final norm (`norm`, default HIDDEN ones) and write the file `writer` holds;
    returns `path`."""
    writer.add_tensor("output_norm.weight",
                      np.ones(HIDDEN, dtype=np.float32) if norm is None else norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_llama(path: Path, type_of: Callable[[str, int], int], seed: int = 0) -> Path:
    """A 2-layer Llama GGUF at `path`: `type_of(role, layer)` gives each matrix's GGUF type
    (roles q, k, v, o, gate, up, down; "embedding" with layer -1 for the tied embedding);
    F16 writes float values (a type the w4a8 kernel does not compute)."""
    import gguf

    rng = np.random.default_rng(seed)
    types = gguf.GGMLQuantizationType
    writer = llama_writer(path, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, context=256)

    def matrix(name: str, rows: int, cols: int, type_id: int) -> None:
        if type_id == F16:
            values = rng.standard_normal((rows, cols), dtype=np.float32) * 0.05
            writer.add_tensor(name, values.astype(np.float16))
            return
        writer.add_tensor(name, random_blocks(rng, rows, cols, type_id),
                          raw_dtype=types(type_id))

    kv = KV_HEADS * HIDDEN // HEADS
    matrix("token_embd.weight", VOCAB, HIDDEN, type_of("embedding", -1))  # tied: the output
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        for role, name, rows, cols in (("q", "attn_q", HIDDEN, HIDDEN), ("k", "attn_k", kv, HIDDEN),
                                       ("v", "attn_v", kv, HIDDEN),
                                       ("o", "attn_output", HIDDEN, HIDDEN)):
            matrix(f"blk.{i}.{name}.weight", rows, cols, type_of(role, i))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, type_of("gate", i))
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, type_of("up", i))
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, type_of("down", i))
    return finish(writer, path)


# Q4_K_M's mix in layer 0's K-quants (and one Q5_K), every block of 32 in layer 1.
EVERY_TYPE = {
    0: {"q": Q4_K, "k": Q5_K, "v": Q6_K, "o": Q4_K, "gate": Q4_K, "up": Q5_K, "down": Q6_K},
    1: {"q": Q4_0, "k": Q4_1, "v": Q8_0, "o": Q5_0, "gate": Q5_1, "up": Q4_0, "down": Q8_0},
    -1: {"embedding": Q6_K},
}


def every_type(role: str, layer: int) -> int:
    """`write_tiny_llama`'s types for a file of every type w4a8 computes."""
    return EVERY_TYPE[layer][role]


# The tiny mixture of experts: 4 experts of width MOE_FFN, 2 a token, in every layer.
EXPERTS, EXPERTS_USED, MOE_FFN = 4, 2, 256
# Its router's values: large enough that a token's top-2 is decided by margins of order one
# (with weights of a few hundredths every expert would be nearly as likely).
ROUTER_STD = 0.5


def write_tiny_moe(path: Path, arch: str, types: dict[str, int], seed: int = 0,
                   experts: int = EXPERTS, split_experts: bool = False,
                   expert_count: int | None = None, chat_template: str | None = None) -> Path:
    """A 2-layer mixture-of-experts GGUF at `path`: `arch` "qwen3moe" (Qwen3-MoE, QK-norm
    per head), "olmoe" (OLMoE, QK-norm over all heads, weights spread around one) or "llama"
    (Mixtral, as llama.cpp writes it). `types` gives the GGUF type of each role:
    "attention" (q, k, v, o), "gate", "up", "down" (the experts' 3-D tensors), "embedding"
    (tied). The router is F32, as llama.cpp keeps it. `split_experts`: one 2-D tensor per
    expert (older converters); `expert_count`: the count written in the header (default:
    `experts`, the tensors' count); `chat_template`: the file's `tokenizer.chat_template`."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = llama_writer(path, HIDDEN, MOE_FFN, LAYERS, HEADS, KV_HEADS, context=256,
                          arch=arch, eps=1e-6)
    writer.add_expert_count(expert_count if expert_count is not None else experts)
    writer.add_expert_used_count(EXPERTS_USED)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(MOE_FFN)
        writer.add_key_length(HIDDEN // HEADS)
        writer.add_value_length(HIDDEN // HEADS)

    def blocks(rows: int, cols: int, type_id: int) -> np.ndarray:
        return random_blocks(rng, rows, cols, type_id)

    kv = KV_HEADS * HIDDEN // HEADS
    writer.add_tensor("token_embd.weight", blocks(VOCAB, HIDDEN, types["embedding"]),
                      raw_dtype=gguf.GGMLQuantizationType(types["embedding"]))
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        for name, rows in (("attn_q", HIDDEN), ("attn_k", kv), ("attn_v", kv),
                           ("attn_output", HIDDEN)):
            writer.add_tensor(f"blk.{i}.{name}.weight",
                              blocks(rows, HIDDEN, types["attention"]),
                              raw_dtype=gguf.GGMLQuantizationType(types["attention"]))
        if arch == "qwen3moe":
            for name in ("attn_q_norm", "attn_k_norm"):
                writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(head_dim, dtype=np.float32))
        if arch == "olmoe":
            for name, width in (("attn_q_norm", HIDDEN), ("attn_k_norm", kv)):
                norm = 1 + 0.3 * rng.standard_normal(width, dtype=np.float32)
                writer.add_tensor(f"blk.{i}.{name}.weight", norm)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        router = rng.standard_normal((experts, HIDDEN), dtype=np.float32) * ROUTER_STD
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", router)
        for role, kind, rows, cols in (("gate", "ffn_gate", MOE_FFN, HIDDEN),
                                       ("up", "ffn_up", MOE_FFN, HIDDEN),
                                       ("down", "ffn_down", HIDDEN, MOE_FFN)):
            type_id = types[role]
            per_expert = [blocks(rows, cols, type_id) for _ in range(experts)]
            if split_experts:
                for e, part in enumerate(per_expert):
                    writer.add_tensor(f"blk.{i}.{kind}.{e}.weight", part,
                                      raw_dtype=gguf.GGMLQuantizationType(type_id))
            else:
                writer.add_tensor(f"blk.{i}.{kind}_exps.weight", np.stack(per_expert),
                                  raw_dtype=gguf.GGMLQuantizationType(type_id))
    return finish(writer, path)


# Q4_K_M's mix for experts (Q4_K gate/up, Q6_K down), and the blocks of 32.
MOE_KQUANTS = {"attention": Q4_K, "gate": Q4_K, "up": Q4_K, "down": Q6_K, "embedding": Q6_K}
MOE_BLOCKS32 = {"attention": Q8_0, "gate": Q4_0, "up": Q5_1, "down": Q8_0, "embedding": Q8_0}


# The GGUF types a tiny gpt-oss's dense matrices (attention, embedding, output) may take.
BF16, F32, MXFP4 = 30, 0, 39


def add_tiny_tokenizer(writer: Any, tokenizer_json: Path, pre: str) -> None:
    """The tiny tokenizer (tiny_reference.build_tiny_tokenizer's tokenizer.json) as a GGUF
    byte-level BPE vocabulary: tokens in id order, its specials CONTROL, its merges, and
    the `pre`-tokenizer name (the split for text; token-id prompts do not use it)."""
    saved = json.loads(tokenizer_json.read_text())
    model = saved["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    # Tokens added after training (special ones) follow the trained vocabulary.
    added = sorted((t["id"], t["content"]) for t in saved["added_tokens"])
    tokens += [content for token_id, content in added if token_id >= len(tokens)]
    assert all(tokens[token_id] == content for token_id, content in added)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<") and t.endswith(">") else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])


def write_tiny_gpt_oss(path: Path, model: Any, dense: int = Q8_0,
                       expert_count: int | None = None, harmony: bool = False,
                       fused_gate_up: bool = False) -> Path:
    """A gpt-oss GGUF at `path` of a transformers GptOssForCausalLM `model`'s weights, laid
    out as llama.cpp's converter writes it: the experts' gate, up and down as 3-D MXFP4
    tensors [experts, out, in] (HF's fused gate_up_proj [experts, in, 2 x out], gate and up
    interleaved, split and transposed) with 2-D float32 biases [experts, out]; the norms,
    sinks, the router and every other bias float32; q/k/v/o, the embedding and the output
    projection in `dense` (F32, F16, BF16 or Q8_0); `expert_count`: the count written in
    the header (default: the model's). The tiny tokenizer (`build_tiny_tokenizer`, written
    beside the file) is its vocabulary, under gpt-oss's pre-tokenizer name; with `harmony`,
    followed by the harmony format's special tokens, `<|return|>` its end token; with
    `fused_gate_up`, each layer's gate and up come as one fused `ffn_gate_up_exps` weight
    [experts, 2 x out, in] and bias [experts, 2 x out], each expert's gate rows first."""
    import gguf
    from tiny_reference import HARMONY_TOKENS, build_tiny_tokenizer

    c = model.config
    rope = c.rope_parameters
    vocab = build_tiny_tokenizer(path.parent, harmony=harmony)
    assert c.vocab_size >= vocab, "the model's vocabulary must cover the tokenizer's"
    writer = llama_writer(path, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                          c.num_attention_heads, c.num_key_value_heads,
                          c.max_position_embeddings, arch="gpt-oss", eps=c.rms_norm_eps,
                          theta=rope["rope_theta"])
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_sliding_window(c.sliding_window)
    writer.add_expert_count(c.num_local_experts if expert_count is None else expert_count)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.intermediate_size)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    add_tiny_tokenizer(writer, path.parent / "tokenizer.json", pre="gpt-4o")
    writer.add_bos_token_id(c.bos_token_id)
    # With harmony, <|return|> (the tokenizer's end token) ends a generation.
    end = vocab - len(HARMONY_TOKENS) + HARMONY_TOKENS.index("<|return|>")
    writer.add_eos_token_id(end if harmony else c.eos_token_id)
    writer.add_pad_token_id(c.pad_token_id)
    w = {name: t.detach().float().numpy() for name, t in model.state_dict().items()}

    def add(name: str, values: np.ndarray, type_id: int = F32) -> None:
        values = np.ascontiguousarray(values, dtype=np.float32)
        if type_id == F32:
            writer.add_tensor(name, values)
        elif type_id == F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            kind = gguf.GGMLQuantizationType(type_id)
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    add("token_embd.weight", w["model.embed_tokens.weight"], dense)
    add("output.weight", w["lm_head.weight"], dense)
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", w[p + "input_layernorm.weight"])
        add(b + "post_attention_norm.weight", w[p + "post_attention_layernorm.weight"])
        add(b + "attn_sinks.weight", w[p + "self_attn.sinks"])
        for kind, proj in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                           ("attn_output", "o_proj")):
            add(f"{b}{kind}.weight", w[f"{p}self_attn.{proj}.weight"], dense)
            add(f"{b}{kind}.bias", w[f"{p}self_attn.{proj}.bias"])
        add(b + "ffn_gate_inp.weight", w[p + "mlp.router.weight"])
        add(b + "ffn_gate_inp.bias", w[p + "mlp.router.bias"])
        gate_up = w[p + "mlp.experts.gate_up_proj"].transpose(0, 2, 1)  # [E, 2 x out, in]
        gate_up_bias = w[p + "mlp.experts.gate_up_proj_bias"]
        if fused_gate_up:
            rows = np.concatenate([gate_up[:, 0::2], gate_up[:, 1::2]], axis=1)
            add(b + "ffn_gate_up_exps.weight", rows, MXFP4)
            add(b + "ffn_gate_up_exps.bias",
                np.concatenate([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], axis=1))
        else:
            add(b + "ffn_gate_exps.weight", gate_up[:, 0::2], MXFP4)
            add(b + "ffn_up_exps.weight", gate_up[:, 1::2], MXFP4)
            add(b + "ffn_gate_exps.bias", gate_up_bias[:, 0::2])
            add(b + "ffn_up_exps.bias", gate_up_bias[:, 1::2])
        add(b + "ffn_down_exps.weight", w[p + "mlp.experts.down_proj"].transpose(0, 2, 1),
            MXFP4)
        add(b + "ffn_down_exps.bias", w[p + "mlp.experts.down_proj_bias"])
    return finish(writer, path, w["model.norm.weight"])
