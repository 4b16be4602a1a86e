"""Tiny Llama-architecture GGUF files whose matrices are random blocks of the GGUF types
w4a8 computes (the K-quants and the blocks of 32), for tests of the default mode on
quantised files without a download."""

from __future__ import annotations

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
                 context: int, arch: str = "llama", eps: float = 1e-5) -> Any:
    """A `gguf.GGUFWriter` at `path` with a Llama-like model's header fields (tensors to
    add; `arch` "qwen3moe" for Qwen3-MoE, whose own fields the caller adds)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_rope_freq_base(10000.0)
    return writer


def finish(writer: Any, path: Path) -> Path:
    """Add the final norm (ones) and write the file `writer` holds; returns `path`."""
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
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
    """A 2-layer mixture-of-experts GGUF at `path`: `arch` "qwen3moe" (Qwen3-MoE, QK-norm)
    or "llama" (Mixtral, as llama.cpp writes it). `types` gives the GGUF type of each role:
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
