/* w8a8: int8 weights x int8 activations.
 * A part of cpu_kernels.c's one translation unit: it may use what common.h and the parts
 * included before it define. */

/* ---- int8 weights x int8 activations (activations quantised per block of 32 on the fly) ---- */

/* The arithmetic of w8a8 (quantization="w8a8", and the matrices of a block type w4a8 does not
 * compute in the default mode), for every output y[r, c]:
 *
 *     isum_b = sum over the 32 j of block b of xq[r, 32b + j] * w[c, 32b + j]   (int32, exact)
 *     acc    = 0;  for b = 0, 1, ...: acc = fma((float)isum_b, xs[r, b], acc)   (block order)
 *     y[r, c] = acc * scale[c]  (+ bias[c])
 *
 * The integer sums are exact whatever order computes them, and the float operations form one
 * fixed chain per output, so y[r, c] is the same bits whatever the number of rows in the call,
 * the tiling, the thread count or the instruction set (every variant, and
 * `loom_linear_w8a8_ref`, compute exactly this). That is what makes a token's logits
 * independent of its batch and chunk. */

#define QBLOCK 32
/* Output columns one weight vector covers (one 256-bit register of int32 sums). */
#define COLS 8
/* Row tiles: rows of x that share each weight load. Registers: RT x 2 column groups x (int32 +
 * float accumulator); AVX-512VL has 32 vector registers, AVX2 16 (which fit 2 rows x 2 groups
 * with the AVX2 path's temporaries, 3 rows with AVX-VNNI's single instruction). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define W8A8_ROWS 4
#elif defined(__AVXVNNI__)
#define W8A8_ROWS 3
#else
#define W8A8_ROWS 2
#endif
/* Bytes of quantised activations per row block (rows x k): small enough to share L1 with a
 * panel's weights, so a panel's row tiles do not evict each other. At most ROW_BLOCK rows. */
#define ROW_BLOCK_BYTES 16384
#define ROW_BLOCK 128
/* Software prefetch distance over the packed weight stream, in bytes. */
#ifndef PACKED_PREFETCH_BYTES
#define PACKED_PREFETCH_BYTES 2048
#endif

/* x [k] float -> xq [k] int8, xs [k / 32] float with x ~ xq * xs per block (symmetric), and
 * xsum [k / 32] = 128 * the sum of each block's xq (what the VNNI path's unsigned weights add):
 * scale d = max|x| / 127, q = round-half-even(x * (1 / d)). One element at a time: the
 * reference that the vector `quantize_row_q8` must equal (the default rounding mode is
 * round-half-even, as lrintf and cvtps2dq use; max and the integer sum are exact in any
 * order). */
static void quantize_row_q8_scalar(const float *x, int64_t k, int8_t *xq, float *xs,
                                   int32_t *xsum) {
    for (int64_t b = 0; b < k / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
        float amax = 0.0f;
        for (int j = 0; j < QBLOCK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        xs[b] = d;
        int32_t s = 0;
        for (int j = 0; j < QBLOCK; j++) {
            const int8_t q = (int8_t)lrintf(xb[j] * id);
            xq[b * QBLOCK + j] = q;
            s += q;
        }
        xsum[b] = 128 * s;
    }
}

/* quantize_row_q8_scalar, 32 elements per step. */
static void quantize_row_q8(const float *x, int64_t k, int8_t *xq, float *xs, int32_t *xsum) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < k / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask),
                                               _mm256_and_ps(v[1], abs_mask)),
                                 _mm256_max_ps(_mm256_and_ps(v[2], abs_mask),
                                               _mm256_and_ps(v[3], abs_mask)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        const float d = amax / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        xs[b] = d;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
        const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                             _mm256_add_epi32(q[2], q[3]));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                                 _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + b * QBLOCK), _mm256_permutevar8x32_epi32(bytes, order));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        xsum[b] = 128 * _mm_cvtsi128_si32(s4);
    }
}

/* xq [m, k], xs and xsum [m, k / 32]: every row of x quantised per block. */
static void quantize_rows_body(const float *x, int64_t m, int64_t k, int8_t *xq, float *xs,
                               int32_t *xsum) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++)
        quantize_row_q8(x + r * k, k, xq + r * k, xs + r * (k / QBLOCK), xsum + r * (k / QBLOCK));
}

/* acc + the exact int32 products of unsigned weights w and signed activations xb, four per
 * lane. VNNI: one instruction, any w; AVX2: u8 x s8 pairs in int16, exact only while a pair
 * cannot saturate (w <= 128: w4a8's weights are at most 63), then pairs of pairs. */
static inline __m256i dot_u8s8(__m256i acc, __m256i w, __m256i xb) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, w, xb);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, xb);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, xb),
                                                   _mm256_set1_epi16(1)));
#endif
}

/* The packed weight (`loom.kernels.w8a8_layout.to_packed_layout`): output columns in
 * groups of COLS, each group's k in steps of 4, as unsigned bytes w + 128:
 *     wp[((g * (k / 4) + s) * COLS + c) * 4 + j] = W[COLS * g + c, 4 s + j] + 128
 * so one 32-byte load holds 4 consecutive k of 8 columns, a group is one sequential stream of
 * 8k bytes, and columns past n (the last group's padding) hold 128 (a zero weight).
 *
 * acc += the int32 products of 4 int8 activations (broadcast) and one loaded weight vector:
 * VNNI multiplies the unsigned weights w + 128 directly (the 128 * sum(x) this adds is taken
 * off once per block through xsum); AVX2 has no such instruction and no unsigned x signed
 * product that cannot saturate on w + 128, so it restores w and multiplies |w| (as unsigned:
 * up to 128, since a GGUF Q8_0 block may hold -128, which no int8 negation gives) by x
 * carrying w's sign (|x| <= 127, as quantize_row_q8 rounds) in int16 pairs (at most
 * 2 * 128 * 127, exact). Same exact sums. */
static inline __m256i dot4x8_i8(__m256i acc, __m256i wu, __m256i xb) {
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
    return dot_u8s8(acc, wu, xb);
#else
    const __m256i w = _mm256_xor_si256(wu, _mm256_set1_epi8((char)0x80));
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xb, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

/* The int32 accumulator a block starts from: minus what the unsigned weights add (VNNI). */
static inline __m256i block_start(int32_t xsum) {
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
    return _mm256_set1_epi32(-xsum);
#else
    (void)xsum;
    return _mm256_setzero_si256();
#endif
}

/* Blocks of 32 k per pass over a row block when k is large: a panel's weights for one pass
 * (16 columns x W8A8_K_BLOCKS * 32 bytes = 8 KB) stay in L1 while the row tiles sweep past
 * them. */
#define W8A8_K_BLOCKS 16

/* Blocks [b0, b1) of y[r0 .. r0 + R, 8 g0 .. 8 (g0 + C)] for R rows of x and C column groups:
 * R * C vectors of 8 outputs, each summed exactly as the file's w8a8 arithmetic says. The
 * float accumulators start from zero (b0 == 0) or from acc (the previous blocks' pass: a
 * float32 stored and reloaded exactly), and end in acc, or, after the last block, scaled
 * into y. acc holds 16 floats per row. */
static inline __attribute__((always_inline)) void w8a8_tile(
    const int8_t *xq, const float *xs, const int32_t *xsum, int64_t r0, int R, int64_t k,
    const uint8_t *wp, int64_t g0, int C, int64_t b0, int64_t b1, float *acc, int prefetch,
    const float *scale, const float *bias, int64_t n, float *y) {
    const int64_t nb = k / QBLOCK, steps = k / 4;
    __m256 facc[W8A8_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            facc[r][c] = b0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * 16 + c * 8);
    const uint8_t *wg[2] = {wp + g0 * steps * 32, wp + (g0 + 1) * steps * 32};
    for (int64_t b = b0; b < b1; b++) {
        __m256i iacc[W8A8_ROWS][2];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) iacc[r][c] = block_start(xsum[(r0 + r) * nb + b]);
        if (prefetch) /* the block's 256 bytes of each group, PACKED_PREFETCH_BYTES ahead */
            for (int c = 0; c < C; c++)
                prefetch_bytes(wg[c] + b * 256 + PACKED_PREFETCH_BYTES, 256);
        for (int s = 0; s < 8; s++) {
            const int64_t step = b * 8 + s;
            __m256i w[2];
            for (int c = 0; c < C; c++)
                w[c] = _mm256_loadu_si256((const __m256i *)(wg[c] + step * 32));
            for (int r = 0; r < R; r++) {
                int32_t x4;
                memcpy(&x4, xq + (r0 + r) * k + step * 4, 4);
                const __m256i xb = _mm256_set1_epi32(x4);
                for (int c = 0; c < C; c++) iacc[r][c] = dot4x8_i8(iacc[r][c], w[c], xb);
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256 d = _mm256_set1_ps(xs[(r0 + r) * nb + b]);
            for (int c = 0; c < C; c++)
                facc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r][c]), d, facc[r][c]);
        }
    }
    if (b1 < nb) {
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) _mm256_storeu_ps(acc + r * 16 + c * 8, facc[r][c]);
        return;
    }
    for (int c = 0; c < C; c++) {
        const int64_t col = (g0 + c) * COLS;
        const int64_t valid = n - col < COLS ? n - col : COLS;
        for (int r = 0; r < R; r++) {
            float *yr = y + (r0 + r) * n + col;
            if (valid == COLS) {
                __m256 v = _mm256_mul_ps(facc[r][c], _mm256_loadu_ps(scale + col));
                if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + col));
                _mm256_storeu_ps(yr, v);
            } else {
                float a[COLS];
                _mm256_storeu_ps(a, facc[r][c]);
                for (int64_t i = 0; i < valid; i++) {
                    const float v = a[i] * scale[col + i];
                    yr[i] = bias ? v + bias[col + i] : v;
                }
            }
        }
    }
}

/* w8a8_tile with R and C as compile-time constants (the accumulators stay in registers). */
static void w8a8_tile_any(const int8_t *xq, const float *xs, const int32_t *xsum, int64_t r0,
                          int R, int64_t k, const uint8_t *wp, int64_t g0, int C, int64_t b0,
                          int64_t b1, float *acc, int prefetch, const float *scale,
                          const float *bias, int64_t n, float *y) {
#define W8A8_CASE(RR, CC)                                                                    \
    if (R == RR && C == CC) {                                                                \
        w8a8_tile(xq, xs, xsum, r0, RR, k, wp, g0, CC, b0, b1, acc, prefetch, scale, bias, n,  \
                  y);                                                                        \
        return;                                                                              \
    }
    W8A8_CASE(1, 1) W8A8_CASE(1, 2) W8A8_CASE(2, 1) W8A8_CASE(2, 2)
#if W8A8_ROWS >= 3
    W8A8_CASE(3, 1) W8A8_CASE(3, 2)
#endif
#if W8A8_ROWS >= 4
    W8A8_CASE(4, 1) W8A8_CASE(4, 2)
#endif
#undef W8A8_CASE
}

/* y[m, n] = the w8a8 arithmetic above over quantised rows xq/xs/xsum and the packed weight.
 * Work items are (panel of two column groups, row block), split statically over the threads
 * in that order: each thread streams its share of the weights from memory once, every row
 * block of a panel reusing the panel from cache; within an item, passes of W8A8_K_BLOCKS
 * blocks keep a large k's panel in L1. Ends without a barrier (a caller running several
 * products that write their own outputs waits once: the MoE block's experts); every
 * output's arithmetic is fixed whatever thread computes it. */
static void w8a8_tasks(const int8_t *xq, const float *xs, const int32_t *xsum, int64_t m,
                       int64_t k, const uint8_t *wp, const float *scale, const float *bias,
                       int64_t n, float *y) {
    const int64_t groups = (n + COLS - 1) / COLS, panels = (groups + 1) / 2, nb = k / QBLOCK;
    int64_t rows = ROW_BLOCK_BYTES / k / W8A8_ROWS * W8A8_ROWS;
    rows = rows < W8A8_ROWS ? W8A8_ROWS : rows > ROW_BLOCK ? ROW_BLOCK : rows;
    const int64_t blocks = (m + rows - 1) / rows;
    float acc[ROW_BLOCK * 16] __attribute__((aligned(32)));
    /* One pass where a whole panel (16 x k bytes) fits in half of L1. */
    const int64_t pass = nb <= 2 * W8A8_K_BLOCKS ? nb : W8A8_K_BLOCKS;
#pragma omp for schedule(static) nowait
    for (int64_t task = 0; task < blocks * panels; task++) {
        const int64_t g0 = task / blocks * 2, rb = task % blocks;
        const int C = g0 + 1 < groups ? 2 : 1;
        const int64_t r_begin = rb * rows, r_end = r_begin + rows < m ? r_begin + rows : m;
        for (int64_t b0 = 0; b0 < nb; b0 += pass) {
            const int64_t b1 = b0 + pass < nb ? b0 + pass : nb;
            for (int64_t r0 = r_begin; r0 < r_end; r0 += W8A8_ROWS) {
                const int R = r_end - r0 < W8A8_ROWS ? (int)(r_end - r0) : W8A8_ROWS;
                w8a8_tile_any(xq, xs, xsum, r0, R, k, wp, g0, C, b0, b1,
                              acc + (r0 - r_begin) * 16, rb == 0 && r0 == r_begin, scale, bias,
                              n, y);
            }
        }
    }
}

/* w8a8_tasks, then a barrier: every thread returns once all of y is written. */
static void w8a8_body(const int8_t *xq, const float *xs, const int32_t *xsum, int64_t m,
                      int64_t k, const uint8_t *wp, const float *scale, const float *bias,
                      int64_t n, float *y) {
    w8a8_tasks(xq, xs, xsum, m, k, wp, scale, bias, n, y);
#pragma omp barrier
}

/* Quantised-activation workspace of a w8a8 call with m rows of k features. */
typedef struct {
    int8_t *xq;
    float *xs;
    int32_t *xsum; /* 128 * X, X the plain sum of a block's int8 values */
    /* w4a8 only (see "w4a8" below): xs * X, and the sums of each block's two halves */
    float *xsx;
    int32_t *x16; /* [rows, 2 * blocks] */
} QuantBuffers;

static QuantBuffers quant_buffers(int64_t m, int64_t k) {
    QuantBuffers q;
    const int64_t nb = m * (k / QBLOCK) + 1;
    q.xq = (int8_t *)aligned_alloc(32, (size_t)((m * k + 31) / 32 * 32));
    q.xs = (float *)malloc((size_t)nb * sizeof(float));
    q.xsum = (int32_t *)malloc((size_t)nb * sizeof(int32_t));
    q.xsx = (float *)malloc((size_t)nb * sizeof(float));
    q.x16 = (int32_t *)malloc((size_t)(2 * nb) * sizeof(int32_t));
    return q;
}

static void free_quant_buffers(QuantBuffers q) {
    free(q.xq), free(q.xs), free(q.xsum), free(q.xsx), free(q.x16);
}

/* y[m, n] = w8a8(x, W) (+ bias) with W packed (see w8a8_body); k a multiple of 32. Rows are
 * independent of each other: a row's result is the same bits in any call. */
LOOM_EXPORT void loom_linear_w8a8_packed(const float *x, int64_t m, int64_t k, const uint8_t *wp,
                                         const float *scale, const float *bias, int64_t n,
                                         float *y) {
    const QuantBuffers q = quant_buffers(m, k);
#pragma omp parallel
    {
        quantize_rows_body(x, m, k, q.xq, q.xs, q.xsum);
        w8a8_body(q.xq, q.xs, q.xsum, m, k, wp, scale, bias, n, y);
    }
    free_quant_buffers(q);
}

/* The w8a8 arithmetic one output at a time in plain C (row-major int8 weight [n, k]): the
 * reference the vector kernels must equal bit for bit (tests). */
LOOM_EXPORT void loom_linear_w8a8_ref(const float *x, int64_t m, int64_t k, const int8_t *w,
                                      const float *scale, const float *bias, int64_t n,
                                      float *y) {
    const int64_t nb = k / QBLOCK;
    const QuantBuffers q = quant_buffers(m, k);
    for (int64_t r = 0; r < m; r++)
        quantize_row_q8_scalar(x + r * k, k, q.xq + r * k, q.xs + r * nb, q.xsum + r * nb);
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < n; c++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t isum = 0;
                for (int j = 0; j < QBLOCK; j++)
                    isum += (int32_t)w[c * k + b * QBLOCK + j] * q.xq[r * k + b * QBLOCK + j];
                acc = fmaf((float)isum, q.xs[r * nb + b], acc);
            }
            const float v = acc * scale[c];
            y[r * n + c] = bias ? v + bias[c] : v;
        }
    free_quant_buffers(q);
}
