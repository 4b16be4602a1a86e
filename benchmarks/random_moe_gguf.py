"""A mixture-of-experts GGUF of a real model's shape with random quantised weights, for load
and speed runs of Qwen3-30B-A3B, Mixtral-8x7B, OLMoE-1B-7B and gpt-oss-20b shaped files
without downloading them.

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
151,936, Mixtral's 32,000 and OLMoE's 50,304): the embedding and output head follow that
vocabulary. OLMoE-1B-7B (GGUF arch "olmoe") is written whole, its QK-norms as wide as all
heads' q and k.

gpt-oss-20b (GGUF arch "gpt-oss", as llama.cpp's converter writes it) is laid out as
ggml-org's published `gpt-oss-20b-mxfp4.gguf`: the experts' gate, up and down as 3-D MXFP4
tensors [experts, out, in] (17-byte blocks of 32: an E8M0 scale byte, then 16 bytes of E2M1
codes; random codes under scales 2^-8 or 2^-7, so weights are a few hundredths and every
projection's output stays of order one), the embedding, the output head and attention q, k,
v, o Q8_0 (random int8 under float16 scales of 0.02-0.04 / 127), and float32 norms,
attention sinks, router (`ffn_gate_inp`) and the biases of q/k/v/o, the router and the
experts. Its vocabulary is the real 201,088 (the output head's bytes a token matter):
SmolLM2's tokens padded with ordinary `[pad_N]` tokens up to id 199,997 and control tokens
`<|reserved_N|>` from 199,998 (where o200k_harmony's specials start), under the "gpt-4o"
pre-tokenizer name gpt-oss files carry. Header: a 128-token sliding window (llama.cpp and
Loom both make the even layers slide: neither reads a pattern from the file), YaRN (factor
32 over an original context of 4,096, theta 150,000), context 131,072.

`layers` may be cut below the model's (`full_layers`): every layer keeps its real sizes, so
the per-layer work of a decode step is unchanged and only the count differs ("N of M
layers" in the results).

    python benchmarks/random_moe_gguf.py --shape qwen3-30b-a3b --out /tmp/q3moe.gguf
    python benchmarks/random_moe_gguf.py --shape mixtral-8x7b --layers 2 --out /tmp/mix.gguf
    python benchmarks/random_moe_gguf.py --shape gpt-oss-20b --layers 2 --out /tmp/oss.gguf
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

Q4_K, Q6_K, Q8_0, MXFP4 = "Q4_K", "Q6_K", "Q8_0", "MXFP4"
# bytes per 256-value block.
_K_BLOCKS = {Q4_K: 144, Q6_K: 210}
# bytes per 32-value block.
_B32_BLOCKS = {Q8_0: 34, MXFP4: 17}
# gpt-oss's vocabulary: o200k_harmony's 199,998 ordinary tokens, then its specials.
GPT_OSS_VOCAB, GPT_OSS_SPECIALS_FROM = 201_088, 199_998


@dataclass(frozen=True)
class MoEShape:
    """A mixture-of-experts model's sizes (`layers` of its `full_layers` written)."""

    arch: str  # GGUF architecture: "qwen3moe", "llama" with experts (Mixtral), "olmoe",
    # "gpt-oss"
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
    sliding_window: int = 0  # gpt-oss: the sliding layers' window
    yarn: tuple[float, int] | None = None  # gpt-oss: YaRN's factor and original context


MOE_SHAPES = {
    # Qwen3-30B-A3B: 48 layers; 16 written (6.15 GiB).
    "qwen3-30b-a3b": MoEShape("qwen3moe", 2048, 16, 48, 32, 4, 128, 128, 8, 768,
                              1_000_000.0, qk_norm=True),
    # Mixtral-8x7B: 32 layers; 4 written (3.76 GiB).
    "mixtral-8x7b": MoEShape("llama", 4096, 4, 32, 32, 8, 128, 8, 2, 14336,
                             1_000_000.0, qk_norm=False),
    # OLMoE-1B-7B: 16 layers, all written (3.94 GiB).
    "olmoe-1b-7b": MoEShape("olmoe", 2048, 16, 16, 16, 16, 128, 64, 8, 1024, 10_000.0,
                            qk_norm=True, context=4096),
    # gpt-oss-20b: 24 layers; 8 written (4.52 GiB; 4 sliding, 4 full).
    "gpt-oss-20b": MoEShape("gpt-oss", 2880, 8, 24, 64, 8, 64, 32, 4, 2880, 150_000.0,
                            qk_norm=False, context=131_072, sliding_window=128,
                            yarn=(32.0, 4096)),
}


def with_layers(shape: MoEShape, layers: int) -> MoEShape:
    """`shape` with `layers` layers written."""
    return dataclasses.replace(shape, layers=layers)


def layer_cut(shape: MoEShape) -> str:
    """The layer cut as the results name it: "N of M layers"."""
    return f"{shape.layers} of {shape.full_layers} layers"


def file_type(shape: MoEShape) -> str:
    """The block mix as the file name and the results name it."""
    return "mxfp4" if shape.arch == "gpt-oss" else "q4_k_m"


def tensor_types(shape: MoEShape) -> str:
    """The tensors' block types, for the results."""
    if shape.arch == "gpt-oss":
        return ("random MXFP4 experts; embedding, output head and attention q/k/v/o Q8_0 "
                "(ggml-org's gpt-oss-20b-mxfp4.gguf's types); router, sinks, norms and "
                "biases F32")
    return "random Q4_K / Q6_K blocks written directly in Q4_K_M's mix"


def _tensors(shape: MoEShape, vocab: int) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy-order dims, block type or "F32") of every tensor, in file order."""
    if shape.arch == "gpt-oss":
        yield from _gpt_oss_tensors(shape, vocab)
        return
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    e, i = shape.experts, shape.expert_ffn
    yield "token_embd.weight", (vocab, h), Q4_K
    for b in range(shape.layers):
        yield f"blk.{b}.attn_norm.weight", (h,), "F32"
        yield f"blk.{b}.attn_q.weight", (q, h), Q4_K
        yield f"blk.{b}.attn_k.weight", (kv, h), Q4_K
        yield f"blk.{b}.attn_v.weight", (kv, h), Q6_K
        yield f"blk.{b}.attn_output.weight", (h, q), Q4_K
        if shape.qk_norm:  # per head; OLMoE's span all heads
            wide = shape.arch == "olmoe"
            yield f"blk.{b}.attn_q_norm.weight", (q if wide else shape.head_dim,), "F32"
            yield f"blk.{b}.attn_k_norm.weight", (kv if wide else shape.head_dim,), "F32"
        yield f"blk.{b}.ffn_norm.weight", (h,), "F32"
        yield f"blk.{b}.ffn_gate_inp.weight", (e, h), "F32"  # the router
        yield f"blk.{b}.ffn_gate_exps.weight", (e, i, h), Q4_K
        yield f"blk.{b}.ffn_up_exps.weight", (e, i, h), Q4_K
        yield f"blk.{b}.ffn_down_exps.weight", (e, h, i), Q6_K
    yield "output_norm.weight", (h,), "F32"
    yield "output.weight", (vocab, h), Q6_K


def _gpt_oss_tensors(shape: MoEShape, vocab: int) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """gpt-oss's tensors as llama.cpp's converter names and shapes them (numpy order)."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    e, i = shape.experts, shape.expert_ffn
    yield "token_embd.weight", (vocab, h), Q8_0
    for b in range(shape.layers):
        yield f"blk.{b}.attn_norm.weight", (h,), "F32"
        for name, rows, cols in (("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h),
                                 ("attn_output", h, q)):
            yield f"blk.{b}.{name}.weight", (rows, cols), Q8_0
            yield f"blk.{b}.{name}.bias", (rows,), "F32"
        yield f"blk.{b}.attn_sinks.weight", (shape.heads,), "F32"
        yield f"blk.{b}.post_attention_norm.weight", (h,), "F32"  # before the experts
        yield f"blk.{b}.ffn_gate_inp.weight", (e, h), "F32"  # the router
        yield f"blk.{b}.ffn_gate_inp.bias", (e,), "F32"
        for name, rows, cols in (("ffn_gate_exps", i, h), ("ffn_up_exps", i, h),
                                 ("ffn_down_exps", h, i)):
            yield f"blk.{b}.{name}.weight", (e, rows, cols), MXFP4
            yield f"blk.{b}.{name}.bias", (e, rows), "F32"
    yield "output_norm.weight", (h,), "F32"
    yield "output.weight", (vocab, h), Q8_0


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


def random_b32_blocks(rng: np.random.Generator, dims: tuple[int, ...], kind: str) -> np.ndarray:
    """Random Q8_0 / MXFP4 blocks of a tensor of `dims` (last dim a multiple of 32): uint8
    [*dims[:-1], bytes per row]. Q8_0: random int8 under a float16 scale of 0.02-0.04 / 127;
    MXFP4: random E2M1 codes (values up to 6, root mean square about 2.9) under an E8M0
    scale byte of 119 or 120 (2^-8 or 2^-7): weights of root mean square 0.01-0.02 either
    way, so a projection of a unit-scale input of 2,880 values gives outputs of order one."""
    size = _B32_BLOCKS[kind]
    count = int(np.prod(dims)) // 32
    blocks = np.frombuffer(rng.bytes(count * size), dtype=np.uint8).reshape(count, size).copy()
    if kind == Q8_0:
        d = (rng.random(count, dtype=np.float32) * 0.5 + 0.5) * np.float32(0.04 / 127)
        blocks[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(count, 2)
    else:
        blocks[:, 0] = rng.integers(119, 121, size=count, dtype=np.uint8)
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
    Mixtral-8x7B, 134 MiB for gpt-oss-20b; gpt-oss's embedding and output head are 587 MiB
    each)."""
    import gguf
    from random_gguf import _TOKENIZER_SOURCE, _copy_tokenizer, stream_tensors

    from loom.loader.resolve import resolve_model_path

    gpt_oss = shape.arch == "gpt-oss"
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
    if not gpt_oss:  # llama.cpp's gpt-oss files leave it to key_length
        writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-6 if shape.arch == "qwen3moe" else 1e-5)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.experts_used)
    if shape.arch in ("qwen3moe", "gpt-oss"):
        writer.add_expert_feed_forward_length(shape.expert_ffn)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.yarn is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(shape.yarn[0])
        writer.add_rope_scaling_orig_ctx_len(shape.yarn[1])
    # LLAMA_FTYPE_MOSTLY_MXFP4_MOE (38) for gpt-oss, else LLAMA_FTYPE_MOSTLY_Q4_K_M
    writer.add_file_type(38 if gpt_oss else 15)
    source = resolve_model_path(_TOKENIZER_SOURCE)
    if gpt_oss:
        vocab = _copy_tokenizer(writer, source, pad_to=GPT_OSS_VOCAB,
                                control_from=GPT_OSS_SPECIALS_FROM, pre="gpt-4o")
    else:
        vocab = _copy_tokenizer(writer, source)
    tensors = list(_tensors(shape, vocab))
    rng = np.random.default_rng(seed)
    began = time.perf_counter()

    def data(name: str, dims: tuple[int, ...], kind: str) -> np.ndarray:
        if name.endswith("ffn_gate_inp.weight"):
            return rng.standard_normal(dims, dtype=np.float32) * np.float32(0.05)
        if name.endswith(".bias"):  # gpt-oss's: small, as trained ones
            return rng.standard_normal(dims, dtype=np.float32) * np.float32(0.01)
        if name.endswith("attn_sinks.weight"):  # one logit a head beside the keys'
            return rng.standard_normal(dims, dtype=np.float32)
        if kind == "F32":
            return np.ones(dims, dtype=np.float32)
        if kind in _B32_BLOCKS:
            return random_b32_blocks(rng, dims, kind)
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
