"""A GGUF file of a real model's shape with random weights, for load and speed runs at the
sizes people deploy (1-8B) without downloading them. Speed and memory do not depend on the
weights' values; run generation benchmarks on such files with EOS ignored.

The file is a Llama-architecture GGUF with SmolLM2's tokenizer (its metadata is copied from
the `smollm2-135m-instruct` GGUF, so the vocabulary is SmolLM2's 49,152 tokens whatever the
shape) and its matrices in Q8_0 (the `gguf` package's quantiser), F16, or Q4_K_M's mix of
K-quant blocks (`--type q4_k_m`: random Q4_K and Q6_K blocks, no quantiser needed; Q6_K where
llama.cpp's Q4_K_M puts it: the output / tied embedding, and attn_v and ffn_down of the
first and last eighth of the layers and every third layer between). Tensors are generated,
quantised and written one at a time, so memory stays near one tensor. Real quantised
values: quantise an F16 file with llama.cpp's own quantiser (`--llama-quantize`, needs
`llama-cpp-python`: the `bench` extra).

    python benchmarks/random_gguf.py --shape smollm2-1.7b --out /tmp/smollm2-1.7b-q8_0.gguf
    python benchmarks/random_gguf.py --shape smollm2-1.7b --type q4_k_m --out /tmp/1.7b-q4km.gguf
    python benchmarks/random_gguf.py --shape llama-8b --type f16 --out /tmp/8b-f16.gguf \\
        --llama-quantize Q4_K_M   # writes /tmp/8b-f16.Q4_K_M.gguf beside it
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Shape:
    """A Llama-architecture model's sizes."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float = 10000.0
    context: int = 8192


SHAPES = {
    "smollm2-360m": Shape(960, 32, 15, 5, 2560, 100000.0),
    "smollm2-1.7b": Shape(2048, 24, 32, 32, 8192, 130000.0),
    "llama-3b": Shape(3072, 28, 24, 8, 8192, 500000.0),  # Llama 3.2 3B's layers
    "llama-8b": Shape(4096, 32, 32, 8, 14336, 500000.0),  # Llama 3.1 8B's layers
}
# llama.cpp's file types for `llama_model_quantize`.
LLAMA_FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
_TOKENIZER_SOURCE = "smollm2-135m-instruct"


def _tensors(shape: Shape, vocab: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF name, (rows, cols) or (n,)) of every tensor, in the order llama.cpp writes."""
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    yield "token_embd.weight", (vocab, shape.hidden)
    for i in range(shape.layers):
        yield f"blk.{i}.attn_norm.weight", (shape.hidden,)
        yield f"blk.{i}.attn_q.weight", (shape.hidden, shape.hidden)
        yield f"blk.{i}.attn_k.weight", (kv, shape.hidden)
        yield f"blk.{i}.attn_v.weight", (kv, shape.hidden)
        yield f"blk.{i}.attn_output.weight", (shape.hidden, shape.hidden)
        yield f"blk.{i}.ffn_norm.weight", (shape.hidden,)
        yield f"blk.{i}.ffn_gate.weight", (shape.ffn, shape.hidden)
        yield f"blk.{i}.ffn_up.weight", (shape.ffn, shape.hidden)
        yield f"blk.{i}.ffn_down.weight", (shape.hidden, shape.ffn)
    yield "output_norm.weight", (shape.hidden,)


def _copy_tokenizer(writer: object, source: Path, pad_to: int | None = None,
                    control_from: int | None = None, pre: str | None = None) -> int:
    """Copy SmolLM2's tokenizer metadata into `writer`; returns the vocabulary size.

    `pad_to`: the token list is padded to that many entries: ids from `control_from` on are
    control tokens `<|reserved_N|>`, those between SmolLM2's last and `control_from`
    ordinary tokens `[pad_N]` that no merge makes (so neither engine ever matches them in
    text). `pre`: the pre-tokenizer name written instead of SmolLM2's."""
    from loom.loader.gguf_reader import GGUFFile

    reader = GGUFFile(source)
    tokens = list(reader.get("tokenizer.ggml.tokens"))
    types = list(reader.get("tokenizer.ggml.token_type"))
    if pad_to is not None and pad_to > len(tokens):
        control = pad_to if control_from is None else max(control_from, len(tokens))
        tokens += [f"[pad_{i}]" for i in range(len(tokens), control)]
        tokens += [f"<|reserved_{i}|>" for i in range(control, pad_to)]
        types += [1] * (control - len(types)) + [3] * (pad_to - control)  # normal, control
    writer.add_tokenizer_model(reader.get("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(pre or reader.get("tokenizer.ggml.pre"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(reader.get("tokenizer.ggml.merges"))
    for key, add in (("bos_token_id", writer.add_bos_token_id),
                     ("eos_token_id", writer.add_eos_token_id),
                     ("unknown_token_id", writer.add_unk_token_id),
                     ("padding_token_id", writer.add_pad_token_id)):
        value = reader.get(f"tokenizer.ggml.{key}")
        if value is not None:
            add(int(value))
    writer.add_add_bos_token(bool(reader.get("tokenizer.ggml.add_bos_token")))
    template = reader.get("tokenizer.chat_template")
    if template:
        writer.add_chat_template(template)
    return len(tokens)


def _q4_k_m_type(name: str, layers: int, tied: bool) -> str:
    """The block type llama.cpp's Q4_K_M gives tensor `name` (Q6_K or Q4_K)."""
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        i = int(name.split(".")[1])
        more_bits = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
        return "Q6_K" if more_bits else "Q4_K"
    return "Q4_K"


def _random_k_blocks(rng: np.random.Generator, dims: tuple[int, ...], kind: str) -> np.ndarray:
    """Random Q4_K / Q6_K blocks of a [rows, cols] tensor with small float16 scales (weights
    of a few hundredths, as trained ones), uint8 [rows, bytes per row]."""
    rows, cols = dims
    count = rows * cols // 256
    size, scale_at = (144, (0, 2)) if kind == "Q4_K" else (210, (208,))
    blocks = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    for at in scale_at:
        scales = (rng.random(count, dtype=np.float32) * 3e-4 + 1e-4).astype(np.float16)
        blocks[:, at:at + 2] = scales.view(np.uint8).reshape(count, 2)
    return blocks.reshape(rows, -1)


def stream_tensors(writer: Any, tensors: list[tuple[str, tuple[int, ...], str]],
                   data: Callable[[str, tuple[int, ...], str], np.ndarray]) -> None:
    """Declare every tensor (name, numpy-order dims, GGML type name; "F32" for float
    vectors), write the header, then each tensor's `data(name, dims, type)` in the declared
    order and close: memory stays near one tensor, however large the file."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    for name, dims, kind in tensors:
        if kind == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            nbytes = quant_shape_to_byte_shape(dims, GGMLQuantizationType[kind])
            writer.add_tensor_info(name, nbytes, np.dtype(np.uint8), int(np.prod(nbytes)),
                                   raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, kind in tensors:
        writer.write_tensor_data(data(name, dims, kind))
    writer.close()


def write_random_gguf(path: Path, shape: Shape, kind: str, seed: int = 0,
                      log: Callable[[str], None] = print) -> Path:
    """Write the file (`kind`: "q8_0", "f16" or "q4_k_m"); returns `path`."""
    import gguf

    from loom.loader.resolve import resolve_model_path

    types = gguf.GGMLQuantizationType
    qtype = {"q8_0": types.Q8_0, "f16": types.F16, "q4_k_m": None}[kind]
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(shape.rope_theta)
    vocab = _copy_tokenizer(writer, resolve_model_path(_TOKENIZER_SOURCE))
    tensors = list(_tensors(shape, vocab))
    names = {name for name, _ in tensors}

    def type_of(name: str) -> Any:
        if qtype is not None:
            return qtype
        return types[_q4_k_m_type(name, shape.layers, "output.weight" not in names)]

    rng = np.random.default_rng(seed)
    began = time.perf_counter()

    def data(name: str, dims: tuple[int, ...], kind: str) -> np.ndarray:
        if kind == "F32":
            return np.ones(dims, dtype=np.float32)
        if qtype is None:
            return _random_k_blocks(rng, dims, kind)
        values = rng.standard_normal(dims, dtype=np.float32) * np.float32(0.02)
        return gguf.quants.quantize(values, qtype)

    stream_tensors(writer, [(name, dims, "F32" if len(dims) == 1 else type_of(name).name)
                            for name, dims in tensors], data)
    log(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in "
        f"{time.perf_counter() - began:.0f} s")
    return path


def llama_quantize(source: Path, ftype_name: str) -> Path:
    """`source` quantised by llama.cpp's own quantiser into `<stem>.<ftype>.gguf` beside it."""
    import llama_cpp

    target = source.with_name(f"{source.stem}.{ftype_name}.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[ftype_name]
    params.nthread = 0
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params)
    if code != 0:
        raise SystemExit(f"llama_model_quantize failed with {code}")
    return target


def main() -> None:
    """Parse the arguments and write the file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--type", choices=["q8_0", "f16", "q4_k_m"], default="q8_0")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llama-quantize", choices=sorted(LLAMA_FTYPES), default=None,
                        help="also quantise the file with llama.cpp's quantiser")
    args = parser.parse_args()
    path = write_random_gguf(args.out, SHAPES[args.shape], args.type, args.seed)
    if args.llama_quantize:
        print(f"wrote {llama_quantize(path, args.llama_quantize)}")


if __name__ == "__main__":
    main()
