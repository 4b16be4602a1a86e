"""Which execution mode a model runs in: dtype, weight quantization, KV and prefill dtypes.

`choose_mode` is a pure function of what the user asked for, what the weights are and what
the host can do (`HostInfo`), so its rules are tested on any machine. The rules:

- `quantization="auto"` (the default): weights a GGUF file stores quantized (the default
  model is Q4_K_M) run as "w4a8" with a float16 KV cache where Loom's CPU kernels run: the
  file's own blocks (Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; `loom.models.w4a8`),
  any other block type as w8a8; everywhere else, and for float checkpoints, the weights' own
  dtype (no quantization). `None` (or "none") always gives exact dequantised float weights;
  "w8a8" (every matrix re-quantised to int8 per output channel) stays a choice.
  The issue that made w4a8 the default asked for it only where it is at least as fast as
  w8a8 at decode and at prefill. It decodes 1.4-1.7x faster on every shape measured (0.27B
  to 8B) and loads in 0.4-0.75x the time and 0.6x the memory, but its compute-bound calls
  measure up to 15% slower on 1-8B files (27% on Gemma 3 270M): the weights' per-block
  scales cost one more float multiply per block of 32 and output than w8a8's per-channel
  scale (docs/performance.md, "w4a8 as the default"). A prompt of 512 tokens with 128 tokens
  out still finishes sooner at every size, so "auto" takes w4a8 (`AUTO_QUANTIZED_GGUF`);
  `quantization="w8a8"` is the choice for prompt-heavy batch work.
- `dtype="auto"`: on a CPU with the kernels, float32 (their fused decode takes float32
  activations: on an AVX-512 BF16 host it decoded 33 tok/s where a bf16 model managed 19-25);
  on CUDA bfloat16 (float16 without bf16); on a CPU without the kernels, bfloat16 only when
  a bf16 matmul measures faster than float32 here (`measure_bf16_speedup`: native on AVX-512
  BF16 / AMX hosts, emulated and several times slower on AVX2 ones), else float32.
- `kv_cache_dtype="auto"`: float16 when "auto" chose w4a8 (decode attention reads half the
  bytes; quality measured in `bench_quality.py`), else the model dtype.
- `prefill_dtype="auto"` (the default): compute-bound calls (prefill chunks, large batches)
  use the same arithmetic as every other call (the default mode's bit-identity across
  batching and chunking rests on it); bfloat16 prefill is never chosen for you.
  `"bfloat16"` multiplies those calls of the decoder layers in bfloat16
  (`large_batch_dtype`; int8 or float weights), faster where the CPU has native bf16
  (AVX-512 BF16, AMX: oneDNN's bf16 matmul), while small calls (decode) keep the float32 /
  int8 kernels: prefill and decode then compute with different arithmetic. It needs float32
  activations on a CPU, and weights a method can multiply in bf16: with
  `quantization="auto"` it takes w8a8 (w4a8 computes every call from the file's blocks; an
  explicit "w4a8" with it is an error). `"float32"` or the model dtype mean the same as
  "auto".
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from loom.cpu_features import cpu_flags
from loom.models.quant_method import QUANTIZATIONS, get_quant_method

# The mode quantization="auto" gives a GGUF file of quantised weights on a CPU with the
# kernels (see the module docstring for why).
AUTO_QUANTIZED_GGUF = "w4a8"
# A bf16 matmul must beat float32 by this factor before dtype="auto" picks bfloat16 on a CPU
# without the kernels (timings are noisy; a tie keeps the exact dtype).
BF16_MIN_SPEEDUP = 1.25
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16",
                  "fp16": "float16", "half": "float16"}


@dataclass(frozen=True)
class HostInfo:
    """What the device can do, as far as the mode choice cares."""

    device: str  # "cpu" or "cuda[:n]"
    cpu_flags: frozenset[str] = frozenset()
    cpu_kernels: bool = False  # Loom's compiled CPU kernels loaded
    # float32 matmul time / bf16 matmul time on the CPU; None: measured when first needed
    # (only a float model with dtype="auto" on a CPU needs it).
    bf16_speedup: float | None = None
    cuda_bf16: bool = False

    @property
    def cpu_isa(self) -> str:
        """The CPU's widest relevant instruction set: amx, avx512-bf16, avx512, avx2 or
        baseline."""
        if "amx_bf16" in self.cpu_flags:
            return "amx"
        if "avx512_bf16" in self.cpu_flags:
            return "avx512-bf16"
        if "avx512f" in self.cpu_flags:
            return "avx512"
        if "avx2" in self.cpu_flags:
            return "avx2"
        return "baseline"

    @classmethod
    def detect(cls, device: str) -> HostInfo:
        """Probe this machine (the bf16 timing is left to `bf16_ratio`, run at most once per
        process)."""
        if device.startswith("cuda"):
            return cls(device=device, cpu_flags=cpu_flags(),
                       cuda_bf16=torch.cuda.is_bf16_supported())
        from loom.kernels import cpu_kernels_available

        return cls(device=device, cpu_flags=cpu_flags(), cpu_kernels=cpu_kernels_available())

    def bf16_ratio(self) -> float:
        """`bf16_speedup`, measuring it here if it was not given."""
        return measure_bf16_speedup() if self.bf16_speedup is None else self.bf16_speedup


@dataclass(frozen=True)
class ExecutionMode:
    """The resolved choice; `describe` is the start-up line's parenthesis."""

    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    # The dtype the decoder layers multiply in for calls of many rows (prefill chunks, large
    # batches: compute-bound; see `set_large_batch_dtype`); None: the same arithmetic as
    # every other call. Only an explicit `prefill_dtype` sets it.
    large_batch_dtype: str | None = None

    def describe(self, host: HostInfo) -> str:
        """e.g. 'w8a8, kv float16, cpu avx2' or 'bfloat16, cuda'."""
        weights = self.quantization or self.dtype
        if self.large_batch_dtype is not None:
            weights += f", prefill {self.large_batch_dtype}"
        where = f"cpu {host.cpu_isa}" if host.device == "cpu" else host.device
        return f"{weights}, kv {self.kv_cache_dtype}, {where}"


def normalize_dtype(name: str | torch.dtype) -> str:
    """A dtype name with aliases resolved ('bf16' -> 'bfloat16'); torch dtypes accepted."""
    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def normalize_quantization(value: str | None) -> str | None:
    """None and 'none' mean no quantization; 'auto' and the method names pass through."""
    if value is None or value == "none":
        return None
    if value not in ("auto", *QUANTIZATIONS):
        raise ValueError(
            f"unsupported quantization {value!r}; choose 'auto', 'none' or one of {QUANTIZATIONS}"
        )
    return value


def choose_mode(
    dtype: str, quantization: str | None, kv_cache_dtype: str, weights_quantized: bool,
    host: HostInfo, prefill_dtype: str = "auto",
) -> ExecutionMode:
    """Resolve the "auto"s (see the module docstring). `dtype` and `kv_cache_dtype` are
    returned as given when not "auto" (validation is the caller's); a `prefill_dtype` this
    mode cannot use raises ValueError."""
    quant = normalize_quantization(quantization)
    on_cpu = host.device == "cpu"
    auto_quant = quant == "auto"
    if auto_quant:
        quant = AUTO_QUANTIZED_GGUF if weights_quantized and on_cpu and host.cpu_kernels \
            else None
    if get_quant_method(quant).needs_cpu_kernels and not (on_cpu and host.cpu_kernels):
        raise ValueError(
            f"quantization {quant!r} runs on Loom's CPU kernels (a CPU where they build); "
            f"this engine runs on {host.device}"
            + ("" if not on_cpu else " without them (see loom.kernels.kernel_status())"))
    dtype = normalize_dtype(dtype)
    if dtype == "auto":
        if not on_cpu:
            dtype = "bfloat16" if host.cuda_bf16 else "float16"
        elif host.cpu_kernels:
            dtype = "float32"  # the kernels take float32 activations
        else:
            dtype = "bfloat16" if host.bf16_ratio() >= BF16_MIN_SPEEDUP else "float32"
    large_batch = _large_batch_dtype(prefill_dtype, dtype, host)
    if large_batch is not None and not get_quant_method(quant).large_batch_dtypes:
        if not auto_quant:
            raise ValueError(
                f"prefill_dtype {prefill_dtype!r} multiplies prefill in another arithmetic, "
                f"but quantization {quant!r} computes every call from the file's blocks; use "
                "'w8a8', 'int8' or none with it")
        quant = "w8a8"  # a bf16 prefill asks for prompt speed: the mode that gives it
    kv = normalize_dtype(kv_cache_dtype)
    if kv == "auto":
        kv = "float16" if auto_quant and quant is not None else dtype
    return ExecutionMode(dtype=dtype, quantization=quant, kv_cache_dtype=kv,
                         large_batch_dtype=large_batch)


def _large_batch_dtype(prefill_dtype: str, dtype: str, host: HostInfo) -> str | None:
    """`ExecutionMode.large_batch_dtype` for a requested `prefill_dtype` and the resolved
    model `dtype`: None unless bfloat16 was asked for explicitly."""
    prefill = normalize_dtype(prefill_dtype)
    if prefill in ("auto", "float32", dtype):
        return None
    if prefill != "bfloat16":
        raise ValueError(
            f"unsupported prefill_dtype {prefill_dtype!r}; choose 'auto', 'float32' or "
            "'bfloat16'"
        )
    if host.device != "cpu" or dtype != "float32":
        raise ValueError(
            f"prefill_dtype 'bfloat16' needs float32 activations on a CPU; this mode runs "
            f"{dtype} on {host.device}"
        )
    return "bfloat16"


@functools.cache
def measure_bf16_speedup(rows: int = 128, features: int = 640, out: int = 2048) -> float:
    """float32 time / bfloat16 time of one prefill-shaped matmul on this CPU (best of 5 after
    a warm-up; about 0.1 s where bf16 is emulated). Above 1: bf16 is faster here."""

    def best(dt: torch.dtype) -> float:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(rows, features, generator=gen).to(dt)
        w = torch.randn(out, features, generator=gen).to(dt)
        torch.nn.functional.linear(x, w)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)
            times.append(time.perf_counter() - start)
        return min(times)

    with torch.inference_mode():
        return best(torch.float32) / max(best(torch.bfloat16), 1e-9)
