"""A mixture-of-experts GGUF of a real model's shape with random quantised weights, for load
and speed runs of Qwen3-30B-A3B and Mixtral-8x7B shaped files without downloading them.

The K-quant blocks are written directly (random quants with small float16 scales, as
`tests/tiny_gguf.py`'s `random_blocks`, and Q4_K's mins set so that the values are centred on
zero): there is no float intermediate, so a file of a 30B shape never needs its f16 form on
disk. Speed and memory do not depend on the
values; run generation benchmarks on such files with EOS ignored. What the values do decide
is which experts a token picks: the F32 router's rows are random normal, so tokens spread over
the experts much as a trained router's do.

The block mix is Q4_K_M's, as the issue sets it: attention q, k, output and the experts'
gate and up Q4_K; attention v and the experts' down Q6_K (every layer: real Q4_K_M files
keep some layers' v and down in Q4_K, so these files read slightly more bytes); the input
embedding Q4_K and the separate output head Q6_K (neither model ties them); the router
(`ffn_gate_inp`) and the norms F32.

Tokenizer: SmolLM2's, copied from the `smollm2-135m-instruct` GGUF as
`benchmarks/random_gguf.py` does, so the vocabulary is SmolLM2's 49,152 tokens (Qwen3's is
151,936 and Mixtral's 32,000): the embedding and output head follow that vocabulary.

`layers` may be cut below the model's (`full_layers`): every layer keeps its real sizes, so
the per-layer work of a decode step is unchanged and only the count differs ("N of M
layers" in the results).

    python benchmarks/random_moe_gguf.py --shape qwen3-30b-a3b --out /tmp/q3moe.gguf
    python benchmarks/random_moe_gguf.py --shape mixtral-8x7b --layers 2 --out /tmp/mix.gguf
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

Q4_K, Q6_K = "Q4_K", "Q6_K"
# bytes per 256-value block.
_K_BLOCKS = {Q4_K: 144, Q6_K: 210}


@dataclass(frozen=True)
class MoEShape:
    """A mixture-of-experts model's sizes (`layers` of its `full_layers` written)."""

    arch: str  # GGUF architecture: "qwen3moe", or "llama" with experts (Mixtral)
    hidden: int
    layers: int
    full_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_used: int
    expert_ffn: int
    rope_theta: float
    qk_norm: bool
    context: int = 8192


MOE_SHAPES = {
    # Qwen3-30B-A3B: 48 layers; 16 written (6.15 GiB).
    "qwen3-30b-a3b": MoEShape("qwen3moe", 2048, 16, 48, 32, 4, 128, 128, 8, 768,
                              1_000_000.0, qk_norm=True),
    # Mixtral-8x7B: 32 layers; 4 written (3.76 GiB).
    "mixtral-8x7b": MoEShape("llama", 4096, 4, 32, 32, 8, 128, 8, 2, 14336,
                             1_000_000.0, qk_norm=False),
}


def with_layers(shape: MoEShape, layers: int) -> MoEShape:
    """`shape` with `layers` layers written."""
    return dataclasses.replace(shape, layers=layers)


def layer_cut(shape: MoEShape) -> str:
    """The layer cut as the results name it: "N of M layers"."""
    return f"{shape.layers} of {shape.full_layers} layers"


def _tensors(shape: MoEShape, vocab: int) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy-order dims, block type or "F32") of every tensor, in file order."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    e, i = shape.experts, shape.expert_ffn
    yield "token_embd.weight", (vocab, h), Q4_K
    for b in range(shape.layers):
        yield f"blk.{b}.attn_norm.weight", (h,), "F32"
        yield f"blk.{b}.attn_q.weight", (q, h), Q4_K
        yield f"blk.{b}.attn_k.weight", (kv, h), Q4_K
        yield f"blk.{b}.attn_v.weight", (kv, h), Q6_K
        yield f"blk.{b}.attn_output.weight", (h, q), Q4_K
        if shape.qk_norm:
            yield f"blk.{b}.attn_q_norm.weight", (shape.head_dim,), "F32"
            yield f"blk.{b}.attn_k_norm.weight", (shape.head_dim,), "F32"
        yield f"blk.{b}.ffn_norm.weight", (h,), "F32"
        yield f"blk.{b}.ffn_gate_inp.weight", (e, h), "F32"  # the router
        yield f"blk.{b}.ffn_gate_exps.weight", (e, i, h), Q4_K
        yield f"blk.{b}.ffn_up_exps.weight", (e, i, h), Q4_K
        yield f"blk.{b}.ffn_down_exps.weight", (e, h, i), Q6_K
    yield "output_norm.weight", (h,), "F32"
    yield "output.weight", (vocab, h), Q6_K


def random_k_blocks(rng: np.random.Generator, dims: tuple[int, ...], kind: str) -> np.ndarray:
    """Random Q4_K / Q6_K blocks of a tensor of `dims` (last dim a multiple of 256), scales
    small enough for weights of a few hundredths: uint8 [*dims[:-1], bytes per row]."""
    size = _K_BLOCKS[kind]
    count = int(np.prod(dims)) // 256
    blocks = np.frombuffer(rng.bytes(count * size), dtype=np.uint8).reshape(count, size).copy()
    d = (rng.random(count, dtype=np.float32) * 2e-3 + 5e-4).astype(np.float16)
    if kind == Q6_K:  # value = d * scale * (q - 32): centred already
        blocks[:, 192:208] &= 0x07  # small int8 sub-block scales
        blocks[:, 208:210] = (d * np.float16(0.5)).view(np.uint8).reshape(count, 2)
    else:
        blocks[:, 4:16] = _q4_k_centred_scales(rng, count)
        blocks[:, 0:2] = d.view(np.uint8).reshape(count, 2)  # d
        blocks[:, 2:4] = blocks[:, 0:2]  # dmin = d
    return blocks.reshape(*dims[:-1], -1)


def _q4_k_centred_scales(rng: np.random.Generator, count: int) -> np.ndarray:
    """Q4_K's 12 bytes of six-bit sub-block scales and mins, uint8 [count, 12], with each
    min = round(7.5 * scale): with dmin = d a value d * scale * q - dmin * min is then
    d * scale * (q - 7.5) give or take rounding, centred on zero like trained weights. (Random
    bytes there give every value a positive mean, the same in every row: every token's hidden
    state would then point the same way and the router would send them all to the same
    experts.)"""
    sc = rng.integers(1, 9, size=(count, 8), dtype=np.uint8)
    m = np.round(sc * 7.5).astype(np.uint8)  # at most 60: six bits
    out = np.empty((count, 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return out


def write_random_moe_gguf(path: Path, shape: MoEShape, seed: int = 0,
                          log: Callable[[str], None] = print) -> Path:
    """Write the file; returns `path`. Memory stays near one tensor (the largest is one
    layer's stacked experts of one projection: 165 MiB for Qwen3-30B-A3B, 385 MiB for
    Mixtral-8x7B)."""
    import gguf
    from random_gguf import _TOKENIZER_SOURCE, _copy_tokenizer, stream_tensors

    from loom.loader.resolve import resolve_model_path

    writer = gguf.GGUFWriter(str(path), arch=shape.arch)
    writer.add_name(f"random {shape.arch} ({layer_cut(shape)})")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.expert_ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-6 if shape.arch == "qwen3moe" else 1e-5)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.experts_used)
    if shape.arch == "qwen3moe":
        writer.add_expert_feed_forward_length(shape.expert_ffn)
    writer.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    vocab = _copy_tokenizer(writer, resolve_model_path(_TOKENIZER_SOURCE))
    tensors = list(_tensors(shape, vocab))
    rng = np.random.default_rng(seed)
    began = time.perf_counter()

    def data(name: str, dims: tuple[int, ...], kind: str) -> np.ndarray:
        if name.endswith("ffn_gate_inp.weight"):
            return rng.standard_normal(dims, dtype=np.float32) * np.float32(0.05)
        if kind == "F32":
            return np.ones(dims, dtype=np.float32)
        return random_k_blocks(rng, dims, kind)

    stream_tensors(writer, tensors, data)
    log(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB, {layer_cut(shape)}) in "
        f"{time.perf_counter() - began:.0f} s")
    return path


def main() -> None:
    """Parse the arguments and write the file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(MOE_SHAPES), required=True)
    parser.add_argument("--layers", type=int, default=None,
                        help="layers to write (default: the shape's cut)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape = MOE_SHAPES[args.shape]
    if args.layers:
        shape = with_layers(shape, args.layers)
    write_random_moe_gguf(args.out, shape, args.seed)


if __name__ == "__main__":
    main()
