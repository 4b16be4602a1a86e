"""The Triton attention kernels compile for the GPU Loom is measured on, on any machine.

Triton compiles ahead of time for a named target with the ptxas it bundles, so a kernel
that would not build on an H100 (a type error, a tile tl.dot rejects, too much shared
memory) fails here, on a CPU-only machine, not first on a user's GPU. The launch
configurations `paged_attention` makes for the default model's shapes (decode tiles split
into parts with windows, prefill tiles in one part with soft-capping; float32, float32 over
a float16 cache, bfloat16) and the merge kernel are compiled for sm_90."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

pytest.importorskip("triton")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")


def _jit_copy_of_kernels():
    """A copy of loom.kernels.triton_attention whose kernels are JIT functions (what
    compiles): the tests run Triton's interpreter on a CPU (conftest), under which the
    module's own kernels are interpreted functions, which do not compile."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        source = importlib.util.find_spec("loom.kernels.triton_attention").origin
        spec = importlib.util.spec_from_file_location("loom_triton_attention_compiled", source)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclass looks its module up there
        spec.loader.exec_module(module)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    return module


ta = _jit_copy_of_kernels()

H100 = GPUTarget("cuda", 90, 32)
HEAD_DIM = 256  # Gemma 3 270M


def _compile(fn, signature: dict[str, str], constants: dict[str, object], warps: int):
    """Compile `fn` for the H100 (the runtime arguments' types, then the constexprs)."""
    full = {**signature, **dict.fromkeys(constants, "constexpr")}
    names = list(full)
    source = ASTSource(fn=fn, signature=full,
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=H100, options={"num_warps": warps})


@pytest.mark.parametrize(("q_dtype", "kv_dtype", "block_q"), [
    ("fp32", "fp32", 1), ("fp32", "fp32", 16), ("fp32", "fp16", 1),
    ("bf16", "bf16", 1), ("bf16", "bf16", 16),
])
def test_attention_kernel_compiles_for_h100(q_dtype, kv_dtype, block_q):
    signature = {
        "q_ptr": f"*{q_dtype}", "k_ptr": f"*{kv_dtype}", "v_ptr": f"*{kv_dtype}",
        "tables_ptr": "*i64", "seq_lens_ptr": "*i64", "q_start_ptr": "*i64",
        "work_seq_ptr": "*i32", "work_qoff_ptr": "*i32", "out_ptr": f"*{q_dtype}",
        "acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "scale": "fp32",
        "softcap": "fp32", "window": "i32", "num_rows": "i32", "max_blocks": "i32",
    }
    group = 4
    block_m = max(ta.MIN_DOT, block_q * group)
    prefill = block_q > 1
    constants = dict(
        NUM_HEADS=4, NUM_KV_HEADS=1, HEAD_DIM=HEAD_DIM, GROUP=group, BLOCK_Q=block_q,
        BLOCK_M=block_m, BLOCK_D=HEAD_DIM, PAGE=16, BLOCK_N=ta.BLOCK_N, SOFTCAP=prefill,
        WINDOW=not prefill, SINGLE_PART=prefill,
        PRECISION="ieee" if q_dtype == "fp32" else "tf32",
    )
    warps = 8 if block_m * HEAD_DIM >= 64 * 128 else 4
    assert block_q == ta.block_q_for(1 if block_q == 1 else 512, group)  # what launches use
    kernel = _compile(ta._attend_part, signature, constants, warps)
    assert kernel.asm.get("cubin")  # machine code for sm_90 was produced


@pytest.mark.parametrize("out_dtype", ["fp32", "bf16"])
def test_merge_kernel_compiles_for_h100(out_dtype):
    signature = {"acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32",
                 "out_ptr": f"*{out_dtype}", "num_rows": "i32", "num_parts": "i32"}
    constants = dict(HEAD_DIM=HEAD_DIM, BLOCK_D=HEAD_DIM, BLOCK_P=ta.MAX_PARTS)
    assert _compile(ta._merge_parts, signature, constants, 4).asm.get("cubin")
