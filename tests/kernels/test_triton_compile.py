"""The Triton kernels compile for the GPU Loom is measured on, on any machine.

Triton compiles ahead of time for a named target with the ptxas it bundles, so a kernel
that would not build on an H100 (a type error, a tile tl.dot rejects, too much shared
memory) fails here, on a CPU-only machine, not first on a user's GPU. The launch
configurations `paged_attention` makes for the default model's shapes (decode tiles split
into parts, with windows and graph padding; prefill tiles in one part, with soft-capping;
float32, float32 over a float16 cache, bfloat16), the merge kernel, the batch-invariant
matmul (loom.kernels.triton_matmul) and the fused norm / rotary / activation kernels
(loom.kernels.triton_elementwise) are compiled for sm_90.

The compiles run in a child process without TRITON_INTERPRET: the suite runs Triton's
interpreter on a CPU (conftest), and under it Triton's own helpers (tl.cdiv, tl.sum, ...)
are interpreted functions that compiled code cannot call."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# (q dtype, cache dtype, query tokens per work item): decode (1) and prefill (16) tiles.
KERNEL_CONFIGS = [("fp32", "fp32", 1), ("fp32", "fp32", 16), ("fp32", "fp16", 1),
                  ("bf16", "bf16", 1), ("bf16", "bf16", 16)]
MERGE_DTYPES = ["fp32", "bf16"]
# (dtype, output columns per tile): the widths block_n_for gives.
MATMUL_CONFIGS = [("bf16", 16), ("bf16", 32), ("bf16", 64), ("bf16", 128), ("fp32", 64),
                  ("fp16", 128)]
ELEMENTWISE_DTYPES = ["fp32", "bf16"]

_CHILD = r'''
import json, sys, warnings
warnings.filterwarnings("ignore")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loom.kernels import triton_attention as ta
from loom.kernels import triton_elementwise as te
from loom.kernels import triton_logsumexp as tl_lse
from loom.kernels import triton_matmul as tm

H100, HEAD_DIM, GROUP = GPUTarget("cuda", 90, 32), 256, 4


def compile_for_h100(fn, signature, constants, warps, **options):
    full = {**signature, **dict.fromkeys(constants, "constexpr")}
    names = list(full)
    source = ASTSource(fn=fn, signature=full,
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    try:
        kernel = triton.compile(source, target=H100, options={"num_warps": warps, **options})
    except Exception as error:
        return f"{type(error).__name__}: {error}"[:2000]
    return "ok" if kernel.asm.get("cubin") else "no cubin"


results = {}
for q_dtype, kv_dtype, block_q in json.loads(sys.argv[1]):
    block_m = ta.tile_rows(GROUP)
    prefill = block_q > 1
    assert block_q == ta.block_q_for(512 if prefill else 1, GROUP)  # what launches use
    signature = {
        "q_ptr": f"*{q_dtype}", "k_ptr": f"*{kv_dtype}", "v_ptr": f"*{kv_dtype}",
        "tables_ptr": "*i64", "seq_lens_ptr": "*i64", "q_start_ptr": "*i64",
        "work_seq_ptr": "*i32", "work_qoff_ptr": "*i32", "real_lens_ptr": "*i64",
        "sinks_ptr": "*fp32", "out_ptr": f"*{q_dtype}", "acc_ptr": "*fp32", "m_ptr": "*fp32",
        "l_ptr": "*fp32",
        "scale": "fp32", "softcap": "fp32", "window": "i32", "num_rows": "i32",
        "max_blocks": "i32",
    }
    constants = dict(
        NUM_HEADS=4, NUM_KV_HEADS=1, HEAD_DIM=HEAD_DIM, GROUP=GROUP, BLOCK_Q=block_q,
        BLOCK_M=block_m, BLOCK_D=HEAD_DIM, PAGE=16, BLOCK_N=ta.BLOCK_N, PART=ta.PART_KEYS,
        SOFTCAP=prefill, WINDOW=not prefill, SINGLE_PART=prefill,
        PRECISION="ieee" if q_dtype == "fp32" else "tf32", PADDED=not prefill,
        SINKS=prefill,  # a single program folds the sinks (split rows: the merge, below)
    )
    warps = 8 if block_m * HEAD_DIM >= 64 * 128 else 4
    results[f"attend {q_dtype} {kv_dtype} {block_q}"] = compile_for_h100(
        ta._attend_part, signature, constants, warps, enable_fp_fusion=False)
for out_dtype in json.loads(sys.argv[2]):
    signature = {"acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "sinks_ptr": "*fp32",
                 "out_ptr": f"*{out_dtype}", "positions_ptr": "*i64", "num_rows": "i32",
                 "num_parts": "i32", "window": "i32"}
    constants = dict(NUM_HEADS=4, HEAD_DIM=HEAD_DIM, BLOCK_D=HEAD_DIM, PART=ta.PART_KEYS,
                     WINDOW=True, SINKS=True)
    results[f"merge {out_dtype}"] = compile_for_h100(ta._merge_parts, signature, constants, 4,
                                                     enable_fp_fusion=False)
for dt, block_n in json.loads(sys.argv[4]):
    signature = {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "b_ptr": f"*{dt}", "y_ptr": f"*{dt}",
                 "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
                 "stride_ym": "i32"}
    constants = dict(HAS_BIAS=block_n == 64, BLOCK_M=tm._BLOCK_M, BLOCK_N=block_n,
                     BLOCK_K=tm._BLOCK_K, PRECISION="ieee" if dt == "fp32" else "tf32")
    results[f"matmul {dt} {block_n}"] = compile_for_h100(tm._matmul, signature, constants, 4,
                                                         num_stages=4)
for dt in ("fp32", "bf16"):
    signature = {"x_ptr": f"*{dt}", "m_ptr": "*fp32", "s_ptr": "*fp32", "cols": "i32",
                 "stride": "i32", "num_chunks": "i32"}
    results[f"logsumexp {dt}"] = compile_for_h100(
        tl_lse._chunk_stats, signature, dict(CHUNK=tl_lse._CHUNK), 8, enable_fp_fusion=False)
signature = {"m_ptr": "*fp32", "s_ptr": "*fp32", "out_ptr": "*fp32", "num_chunks": "i32"}
results["logsumexp combine"] = compile_for_h100(
    tl_lse._combine_chunks, signature, dict(BLOCK_C=64), 1, enable_fp_fusion=False)
results["attend alignment-free"] = sorted(
    p.name for p in ta._attend_part.params if p.do_not_specialize_on_alignment)
for dt in json.loads(sys.argv[3]):
    for gemma in (True, False):
        for res in (True, False):
            signature = {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "res_ptr": f"*{dt}",
                         "out_ptr": f"*{dt}", "dim": "i32", "x_stride": "i32",
                         "res_stride": "i32", "out_stride": "i32", "eps": "fp32"}
            results[f"rms_norm {dt} {gemma} {res}"] = compile_for_h100(
                te._rms_norm_kernel, signature, dict(GEMMA=gemma, HAS_RES=res, BLOCK=1024), 4)
        for norm in (True, False):
            signature = {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "cos_ptr": f"*{dt}",
                         "sin_ptr": f"*{dt}", "out_ptr": f"*{dt}", "x_tok_stride": "i32",
                         "x_head_stride": "i32", "heads": "i32", "eps": "fp32"}
            results[f"norm_rope {dt} {gemma} {norm}"] = compile_for_h100(
                te._norm_rope_kernel, signature,
                dict(HEAD_DIM=HEAD_DIM, NORM=norm, GEMMA=gemma), 4)
    for act in (0, 1):
        signature = {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}", "width": "i32",
                     "x_stride": "i32"}
        results[f"gated_act {dt} {act}"] = compile_for_h100(
            te._gated_act_kernel, signature, dict(ACT=act, BLOCK=te._ACT_BLOCK), 4)
print(json.dumps(results))
'''


@pytest.fixture(scope="module")
def compiled() -> dict[str, str]:
    """Every configuration compiled in one child process: name -> "ok" or the error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(KERNEL_CONFIGS), json.dumps(MERGE_DTYPES),
         json.dumps(ELEMENTWISE_DTYPES), json.dumps(MATMUL_CONFIGS)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("q_dtype", "kv_dtype", "block_q"), KERNEL_CONFIGS)
def test_attention_kernel_compiles_for_h100(compiled, q_dtype, kv_dtype, block_q):
    assert compiled[f"attend {q_dtype} {kv_dtype} {block_q}"] == "ok"


@pytest.mark.parametrize("out_dtype", MERGE_DTYPES)
def test_merge_kernel_compiles_for_h100(compiled, out_dtype):
    assert compiled[f"merge {out_dtype}"] == "ok"


@pytest.mark.parametrize(("dtype", "block_n"), MATMUL_CONFIGS)
def test_invariant_matmul_compiles_for_h100(compiled, dtype, block_n):
    assert compiled[f"matmul {dtype} {block_n}"] == "ok"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_row_logsumexp_compiles_for_h100(compiled, dtype):
    assert compiled[f"logsumexp {dtype}"] == "ok"
    assert compiled["logsumexp combine"] == "ok"


def test_step_metadata_alignment_does_not_choose_a_compile(compiled):
    """The metadata fields of a step are views of one packed tensor, so whether each starts on
    16 bytes depends on the step's batch and item counts; a pointer specialised on alignment
    would compile the attention kernel again (1.5 s on an H100) the first time the parity
    changes, in the middle of serving."""
    assert compiled["attend alignment-free"] == sorted([
        "tables_ptr", "seq_lens_ptr", "q_start_ptr", "work_seq_ptr", "work_qoff_ptr",
        "real_lens_ptr"])


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
def test_elementwise_kernels_compile_for_h100(compiled, dtype):
    """Every fused norm / rotary / gated-activation variant the layers launch."""
    kinds = ("rms_norm", "norm_rope", "gated_act")
    variants = {name: error for name, error in compiled.items()
                if name.split()[0] in kinds and name.split()[1] == dtype}
    failed = {name: error for name, error in variants.items() if error != "ok"}
    assert len(variants) == 10 and not failed, failed
