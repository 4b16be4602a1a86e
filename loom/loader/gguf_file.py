"""GGUF files: HF-style config from metadata, dequantised tensors under HF names."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from loom.errors import InvalidModelError, UnsupportedModelError
from loom.kernels import GGUF_C_BLOCK_TYPES, dequantize_gguf_blocks
from loom.loader.gguf_maps import (
    GGUF_ARCHITECTURES,
    GGUF_BARE_TENSORS,
    GGUF_CONFIG_DEFAULTS,
    GGUF_CONFIG_KEYS,
    GGUF_CONFIG_KEYS_OVERRIDES,
    GGUF_EXPERT_ARCHITECTURES,
    GGUF_EXPERT_TENSORS,
    GGUF_FUSED_EXPERT_TENSORS,
    GGUF_GLOBAL_TENSORS,
    GGUF_LAYER_TENSORS,
    GGUF_LAYER_TENSORS_OVERRIDES,
    GGUF_NORM_PLUS_ONE,
    GGUF_PERMUTED_QK,
    GGUF_ROPE_SCALING_DEFAULTS,
    GGUF_ROPE_SCALING_KEYS,
    GGUF_SKIPPED_TENSORS,
    GGUF_SLIDING_PERIOD,
    GGUF_SPLIT_EXPERT_TENSORS,
    GGUF_TOKEN_ID_KEYS,
)
from loom.loader.gguf_read_ahead import ReadAhead
from loom.loader.gguf_reader import GGUFFile, GGUFTensorInfo
from loom.loader.source import BlocksHook, WeightIterator
from loom.models.weight_shard import WeightSelector


def gguf_architecture(reader: GGUFFile) -> str:
    """`general.architecture`, checked against the supported set."""
    arch = str(reader.get("general.architecture"))
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    return arch


def gguf_to_hf_config(reader: GGUFFile) -> dict[str, Any]:
    """Build an HF config.json-style dict from GGUF metadata."""
    arch = gguf_architecture(reader)
    hf_arch, model_type = GGUF_ARCHITECTURES[arch]
    if arch in GGUF_EXPERT_ARCHITECTURES and int(reader.get(f"{arch}.expert_count") or 0):
        hf_arch, model_type = GGUF_EXPERT_ARCHITECTURES[arch]
    config: dict[str, Any] = {"architectures": [hf_arch], "model_type": model_type}
    config.update(GGUF_CONFIG_DEFAULTS.get(arch, {}))
    for suffix, hf_key in {**GGUF_CONFIG_KEYS, **GGUF_CONFIG_KEYS_OVERRIDES.get(arch, {})}.items():
        value = reader.get(f"{arch}.{suffix}")
        if value is not None:
            config[hf_key] = value
    for key, hf_key in GGUF_TOKEN_ID_KEYS.items():
        value = reader.get(key)
        if value is not None:
            config[hf_key] = int(value)
    names = {t.name for t in reader.tensors}
    config["tie_word_embeddings"] = "output.weight" not in names
    if "vocab_size" not in config:
        embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
        config["vocab_size"] = int(embed.shape[0])
    config.setdefault(
        "head_dim", config["hidden_size"] // config["num_attention_heads"]
    )
    if "norm_topk_prob" in config:
        config["norm_topk_prob"] = bool(config["norm_topk_prob"])
    scaling_type = reader.get(f"{arch}.rope.scaling.type")
    if scaling_type and scaling_type != "none":
        config["rope_scaling"] = _rope_scaling(reader, arch, str(scaling_type))
    if arch in GGUF_SLIDING_PERIOD:
        config["layer_types"] = _layer_types(config["num_hidden_layers"],
                                             GGUF_SLIDING_PERIOD[arch])
    if arch == "gemma3":
        # Matches what transformers builds from the same file (its Gemma3TextConfig default
        # equals head_dim for 270M/1B/4B/12B).
        config["query_pre_attn_scalar"] = config["head_dim"]
        config["eos_token_id"] = _gemma3_eos(reader, config.get("eos_token_id"))
    return config


def _rope_scaling(reader: GGUFFile, arch: str, scaling_type: str) -> dict[str, Any]:
    """HF `rope_scaling` from `{arch}.rope.scaling.*`: the file's values over the
    architecture's defaults; factor 1 where the file gives none."""
    scaling: dict[str, Any] = {"rope_type": scaling_type, "factor": 1.0,
                               **GGUF_ROPE_SCALING_DEFAULTS.get(arch, {})}
    for suffix, key in GGUF_ROPE_SCALING_KEYS.items():
        value = reader.get(f"{arch}.rope.scaling.{suffix}")
        if value is not None:
            scaling[key] = int(value) if key == "original_max_position_embeddings" \
                else float(value)
    return scaling


def _layer_types(layers: int, period: int) -> list[str]:
    """HF `layer_types` of layers alternating with `period`: the last of every period full
    attention, the others sliding (`GGUF_SLIDING_PERIOD`)."""
    return ["full_attention" if i % period == period - 1 else "sliding_attention"
            for i in range(int(layers))]


def _gemma3_eos(reader: GGUFFile, eos: int | None) -> list[int]:
    """<eos> plus <end_of_turn> (id 106 in Gemma 3 vocabularies), which ends chat turns."""
    ids = [eos] if eos is not None else []
    eot = reader.get("tokenizer.ggml.eot_token_id")
    if eot is not None:
        ids.append(int(eot))
    elif _token(reader, 106) == "<end_of_turn>":
        ids.append(106)
    return ids


def _token(reader: GGUFFile, index: int) -> str | None:
    try:
        return str(reader.array_item("tokenizer.ggml.tokens", index))
    except (KeyError, IndexError):
        return None


def gguf_to_hf_name(arch: str, name: str) -> str | None:
    """HF name of a GGUF tensor (None for tensors with no HF counterpart). A 3-D expert
    tensor's name holds an `{expert}` field: it is one tensor per expert (`_pieces`); a
    fused one's also a `{part}` field: its rows are the parts' (GGUF_FUSED_EXPERT_TENSORS)."""
    if name in GGUF_SKIPPED_TENSORS:
        return None
    if name in GGUF_GLOBAL_TENSORS:
        return GGUF_GLOBAL_TENSORS[name]
    parts = name.split(".")
    if len(parts) == 5 and parts[0] == "blk" and parts[2] in GGUF_SPLIT_EXPERT_TENSORS \
            and parts[3].isdigit():  # one expert of a file from an older converter
        _, layer, kind, expert, ending = parts
        return (f"model.layers.{layer}.mlp.experts.{expert}."
                f"{GGUF_SPLIT_EXPERT_TENSORS[kind]}.{ending}")
    if len(parts) != 4 or parts[0] != "blk":
        raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")
    _, layer, kind, ending = parts
    if kind in GGUF_BARE_TENSORS:
        ending = ""  # the HF name is the parameter itself (attention sinks)
    if kind in GGUF_EXPERT_TENSORS:
        return f"model.layers.{layer}.mlp.experts.{{expert}}.{GGUF_EXPERT_TENSORS[kind]}.{ending}"
    if kind in GGUF_FUSED_EXPERT_TENSORS:
        return f"model.layers.{layer}.mlp.experts.{{expert}}.{{part}}.{ending}"
    table = {**GGUF_LAYER_TENSORS, **GGUF_LAYER_TENSORS_OVERRIDES.get(arch, {})}
    if kind not in table:
        raise UnsupportedModelError(f"GGUF tensor {name!r} has no HF mapping for {arch}")
    return f"model.layers.{layer}.{table[kind]}" + (f".{ending}" if ending else "")


def _unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved -> rotate-half rope layout)."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _qk_heads_key(hf_name: str) -> str:
    """The config key of the head count a permuted q or k projection's rows follow."""
    return "num_attention_heads" if "q_proj" in hf_name else "num_key_value_heads"


def iter_gguf_weights(
    reader: GGUFFile, config: dict[str, Any], dtype: torch.dtype | None = None,
    select: WeightSelector | None = None, keep_blocks: BlocksHook | None = None,
) -> WeightIterator:
    """Yield (hf_name, tensor), dequantised to float32, fixed up, then cast to `dtype`. A
    tensor `select` names a part of is yielded as that part; a part made of whole rows is
    read and dequantised alone (each row of a quantised tensor is its own blocks).

    `keep_blocks(hf_name, type_id, blocks)` is offered every quantised 2-D tensor before it
    is yielded; `blocks()` gives a private copy of its whole file blocks as uint8 [rows,
    bytes per row] (copy-on-write: the file's pages mapped, `GGUFFile.map_tensor`), rows in
    the order of the yielded tensor (q/k rows un-permuted as its values are), so a tensor
    the hook does not keep is never read (a tensor-parallel rank's hook cuts its part).
    Those tensors are read on a thread ahead of the one yielded (`ReadAhead`).
    Where it returns True (the caller computes from the blocks and never reads the values)
    the tensor, or the part `select` names, is yielded as a tensor of its shape on the meta
    device: no dequantising, no storage (`CausalLM.load_weights` leaves its parameter on
    the meta device for the preparation that replaces it).

    A 3-D expert tensor [experts, rows, columns] is yielded as one 2-D tensor per expert
    (`experts.<e>.` in its name), each offered to `keep_blocks` and cut by `select` alone;
    InvalidModelError names a tensor whose expert count is not the file's."""
    arch = gguf_architecture(reader)
    experts = int(config.get("num_experts") or 0)
    names = [gguf_to_hf_name(arch, tensor.name) for tensor in reader.tensors]
    # The tensors whose blocks `keep_blocks` is likely to keep are read on a thread, ahead;
    # a file read from the disk leaves the page cache as its blocks are done with.
    planned = [] if keep_blocks is None else [
        at for at, (tensor, hf_name) in enumerate(zip(reader.tensors, names, strict=True))
        if hf_name is not None and _has_blocks(tensor, hf_name)]
    ahead = ReadAhead(reader, planned, drop_cached=reader.cached_fraction() < _CACHED) \
        if planned else None
    planned = set(planned)
    try:
        for at, (tensor, hf_name) in enumerate(zip(reader.tensors, names, strict=True)):
            if hf_name is None:
                continue
            if at + 1 < len(reader.tensors) and at + 1 not in planned:
                reader.prefetch(reader.tensors[at + 1])  # read while this one is converted
            raw = reader.tensor_data(tensor)
            read = functools.partial(ahead.take, at) if ahead is not None else \
                functools.partial(reader.read_tensor, tensor)
            owned = _OwnedCopy(read)
            for piece_name, expert, rows, shape in _pieces(tensor, hf_name, experts):
                piece = raw if expert is None else raw[expert][rows]
                yield from _piece_weights(tensor, arch, config, piece_name, piece, shape,
                                          owned.piece(expert, rows), dtype, select,
                                          keep_blocks)
            del raw, owned
            if ahead is not None:
                ahead.done(at)
            reader.release(tensor)  # its values are copied out (or its blocks, or nothing)
    finally:
        if ahead is not None:
            ahead.close()


# A file with less than this share of its pages in the page cache when a load begins is
# read from the disk; the load drops the pages it reads once done with them (a warm start
# reads the prepared weights, not the file), and leaves a file mostly cached as it is.
_CACHED = 0.5


def _has_blocks(tensor: GGUFTensorInfo, hf_name: str) -> bool:
    """Whether the pieces of `tensor` are offered to `keep_blocks` (`_piece_weights`):
    quantised blocks of a 2-D tensor or of a 3-D expert tensor's experts."""
    experts = "{expert}" in hf_name
    two_d = len(tensor.shape) == (3 if experts else 2)
    return two_d and tensor.as_bytes and tensor.qtype.name not in _FLOAT_TYPES


class _OwnedCopy:
    """A tensor's private copy (`read()`), taken when the first of its pieces asks for its
    blocks; each piece is a view of it (an expert's slab)."""

    def __init__(self, read: Callable[[], np.ndarray]) -> None:
        self._read = read
        self._data: np.ndarray | None = None

    def piece(self, expert: int | None, rows: slice = slice(None)) -> Callable[[], np.ndarray]:
        """The owned data of one expert's slab of the tensor, or of its `rows` (None: the
        whole tensor)."""

        def get() -> np.ndarray:
            if self._data is None:
                self._data = self._read()
            return self._data if expert is None else self._data[expert][rows]

        return get


def _pieces(tensor: GGUFTensorInfo, hf_name: str, experts: int,
            ) -> list[tuple[str, int | None, slice, tuple[int, ...]]]:
    """(hf_name, expert, rows, shape) of each tensor the model loads from `tensor`: itself
    (expert None), or one per expert of a 3-D expert tensor or of a 2-D expert bias (each
    expert's rows are contiguous in the file, so an expert's data is its slab: index
    `expert` of the tensor's data), or, for a fused expert tensor (a `{part}` name), one per
    expert and part, each part an equal run of the slab's `rows` in the parts' order."""
    shape = tuple(tensor.shape)
    if hf_name.endswith(".mlp.gate.weight") and (len(shape) != 2 or shape[0] != experts):
        raise InvalidModelError(
            f"GGUF tensor {tensor.name!r} has shape {shape}: the router of the file's"
            f" expert_count of {experts} experts must be [{experts}, hidden]")
    whole = slice(None)
    if "{expert}" not in hf_name:
        return [(hf_name, None, whole, shape)]
    bias = hf_name.endswith(".bias")  # [experts, rows], one bias an expert
    if len(shape) != (2 if bias else 3) or shape[0] != experts:
        raise InvalidModelError(
            f"GGUF tensor {tensor.name!r} has shape {shape}: an expert tensor of the file's"
            f" expert_count of {experts} experts must be [{experts}, rows"
            f"{'' if bias else ', columns'}]")
    if "{part}" not in hf_name:
        return [(hf_name.format(expert=e), e, whole, shape[1:]) for e in range(experts)]
    parts = GGUF_FUSED_EXPERT_TENSORS[tensor.name.split(".")[2]]
    if shape[1] % len(parts):
        raise InvalidModelError(
            f"GGUF tensor {tensor.name!r} has shape {shape}: its {shape[1]} rows an expert do "
            f"not split into its {len(parts)} fused parts ({', '.join(parts)})")
    rows = shape[1] // len(parts)
    return [(hf_name.format(expert=e, part=part), e, slice(j * rows, (j + 1) * rows),
             (rows, *shape[2:]))
            for e in range(experts) for j, part in enumerate(parts)]


def _piece_weights(
    tensor: GGUFTensorInfo, arch: str, config: dict[str, Any], hf_name: str,
    raw: np.ndarray, shape: tuple[int, ...], owned: Callable[[], np.ndarray],
    dtype: torch.dtype | None, select: WeightSelector | None, keep_blocks: BlocksHook | None,
) -> WeightIterator:
    """The (hf_name, tensor) `iter_gguf_weights` yields for one piece of a file tensor:
    `raw` its data in the file's mapping (what dequantising reads), `owned()` a private
    copy of it that lives as long as it is referred to (what kept blocks become)."""
    rule = select(hf_name) if select is not None else None
    permuted = arch in GGUF_PERMUTED_QK and hf_name.endswith(("q_proj.weight", "k_proj.weight"))
    if keep_blocks is not None and len(shape) == 2 and raw.dtype == np.uint8 \
            and tensor.qtype.name not in _FLOAT_TYPES:

        def blocks(rows: int = int(shape[0]),
                   heads: str | None = _qk_heads_key(hf_name) if permuted else None,
                   ) -> torch.Tensor:
            copy = torch.from_numpy(owned().reshape(rows, -1))
            if heads is None:
                return copy
            return _unpermute_qk(copy, int(config[heads])).contiguous()

        if keep_blocks(hf_name, int(tensor.qtype), blocks):
            kept_shape = list(shape)
            if rule is not None and not rule.first_rank_only:  # a rank's part of it
                kept_shape[rule.dim] = rule.stop - rule.start
            yield hf_name, torch.empty(tuple(kept_shape), dtype=dtype or torch.float32,
                                       device="meta")
            return
    if rule is not None and rule.dim == 0 and not rule.first_rank_only and not permuted:
        start, stop = rule.span(shape[0])
        part = _dequantize_by_rows(raw[start:stop], tensor.qtype, (stop - start, *shape[1:]))
        yield hf_name, _cast(rule.pad(part), dtype)
        return
    w = _dequantize_by_rows(raw, tensor.qtype, shape)
    if arch in GGUF_NORM_PLUS_ONE and tensor.name.endswith("norm.weight"):
        w = w - 1.0
    if permuted:
        w = _unpermute_qk(w, int(config[_qk_heads_key(hf_name)]))
    yield hf_name, _cast(w if rule is None else rule.apply(w), dtype)


# Elements `_dequantize_by_rows` converts at a time: gguf's dequantisers make several
# temporaries of their output's size, so a whole 128k-row embedding at once would briefly
# need a few times its float32 size.
_DEQUANTIZE_SLICE = 1 << 20


def _dequantize_by_rows(raw: np.ndarray, qtype: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's raw data dequantised to float32 `shape`: by Loom's C kernels where they
    decode the type (`loom_dequantize`, gguf's arithmetic bit for bit), else by gguf's numpy
    dequantisers a slice of rows at a time into one preallocated tensor (each row of a
    quantised tensor is its own blocks, so the values are those of one whole call)."""
    if int(qtype) in GGUF_C_BLOCK_TYPES and raw.dtype == np.uint8 and raw.flags.c_contiguous:
        out = torch.empty(shape, dtype=torch.float32)
        if dequantize_gguf_blocks(raw, int(qtype), out):  # in C, the same bits, one pass
            return out
    rows = shape[0] if len(shape) == 2 else 0
    if rows < 2 or math.prod(shape) <= _DEQUANTIZE_SLICE:
        return _float_tensor(dequantize(raw, qtype), shape)
    out = torch.empty(shape, dtype=torch.float32)
    step = max(1, _DEQUANTIZE_SLICE // shape[1])
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        part = np.asarray(dequantize(raw[start:stop], qtype), dtype=np.float32)
        out[start:stop] = torch.from_numpy(part.reshape(stop - start, shape[1]))
    return out


def _float_tensor(array: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """A dequantised array as a float32 tensor of `shape`, copied only where it must be: a
    float32 result the dequantiser made is taken as it is (a read-only view of the mapped
    file, as an F32 tensor's is, is copied, since tensors must be writable)."""
    array = np.asarray(array, dtype=np.float32).reshape(shape)
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array, dtype=np.float32, order="C")
    return torch.from_numpy(array)


def _cast(w: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return w if dtype is None else w.to(dtype)


# Tensor types that hold plain floats (a GGUF made only of these is a float checkpoint).
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def gguf_is_quantized(path: Path) -> bool:
    """Whether any 2-D weight of the file is stored in a quantized block type."""
    reader = GGUFFile(path)
    return any(
        t.qtype.name not in _FLOAT_TYPES for t in reader.tensors if len(t.shape) >= 2
    )


def load_gguf(
    path: Path, dtype: torch.dtype | None = None, select: WeightSelector | None = None,
    keep_blocks: BlocksHook | None = None,
) -> tuple[dict[str, Any], WeightIterator]:
    """Config dict and lazy weight iterator of a .gguf file (see `iter_gguf_weights`)."""
    reader = GGUFFile(path)
    config = gguf_to_hf_config(reader)
    check_tensor_types(reader)
    return config, iter_gguf_weights(reader, config, dtype, select, keep_blocks)


def check_tensor_types(reader: GGUFFile) -> None:
    """UnsupportedModelError naming the first block type no decoder here reads (Loom's C
    kernels or `gguf`'s numpy code), before any tensor is read or allocated."""
    tried: dict[Any, bool] = {}
    for tensor in reader.tensors:
        qtype = tensor.qtype
        if qtype.name in ("F32", "F16") or int(qtype) in GGUF_C_BLOCK_TYPES:
            continue
        if qtype not in tried:
            tried[qtype] = _gguf_decodes(qtype)
        if not tried[qtype]:
            raise UnsupportedModelError(
                f"GGUF tensor {tensor.name!r} is stored as {qtype.name}, a block type Loom "
                "cannot decode; convert the file to a supported type (for example Q4_K_M "
                "or Q8_0)")


def _gguf_decodes(qtype: Any) -> bool:
    """Whether `gguf`'s dequantisers read blocks of `qtype` (tried on one zero block)."""
    block_bytes = GGML_QUANT_SIZES.get(qtype, (0, 0))[1]
    if not block_bytes:
        return False
    try:
        dequantize(np.zeros(block_bytes, dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError, KeyError):
        return False
    return True
