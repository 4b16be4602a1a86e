/* Loom's CPU kernels (x86-64, AVX2 + FMA), built at first use by loom/kernels/build.py.
 * The same source builds every variant there (AVX2; AVX-512 VNNI, where `dot32_i8` is one
 * instruction); `#if` blocks select the wider code and must keep every result identical.
 *
 * Plain C with a C ABI and no PyTorch headers, so it compiles in about a second and is
 * called through ctypes with tensor data pointers. All tensors are float32 unless named
 * otherwise, contiguous, and owned by the caller. Threads come from OpenMP; the library
 * links libgomp.so.1, the same runtime PyTorch has already loaded, so both share one pool.
 *
 * Every kernel is a `*_body` function made of OpenMP worksharing loops (each ending in a
 * barrier), which all threads of an enclosing parallel region call together, plus an exported
 * wrapper that opens that region. The fused decoder (decoder_layer.c) runs a whole step's
 * layers inside one region: waking sleeping threads for every small operation costs more than the
 * operation itself on a decode step.
 *
 * One file per job under cpu/, compiled as this one translation unit (the parts share static
 * helpers and each may use what a part before it defines, so their order below is part of
 * the source): the compiler sees one file, so inlining across the jobs and the variants'
 * code are as before the split, and the build keys its cache on every part's bytes.
 */

#include "cpu/common.h"
#include "cpu/linear_w8.c"
#include "cpu/attention.c"
#include "cpu/norm_rope.c"
#include "cpu/w8a8.c"
#include "cpu/linear_f32.c"
#include "cpu/decoder_layer.c"
#include "cpu/token_bitmask.c"
#include "cpu/greedy.c"
#include "cpu/dequantize.c"
#include "cpu/w4a8_kquants.c"
#include "cpu/w4a8_blocks32.c"
#include "cpu/moe.c"
