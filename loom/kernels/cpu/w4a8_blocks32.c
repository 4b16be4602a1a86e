/* w4a8 from GGUF blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4).
 * A part of cpu_kernels.c's one translation unit: it may use what common.h and the parts
 * included before it define. */

/* ---- w4a8 over blocks of 32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4 ----
 *
 * Files store a matrix in these where its rows are not whole super-blocks of 256 (the K-quant
 * fallbacks of Q4_K_M files: Gemma 3 270M's 640-wide q/k/v and gate/up are Q5_0), or all of
 * it (Q4_0, Q8_0 files). One record per group of 8 columns and block of 32 k:
 *   d[8] 16 bits | m[8] f16 (Q4_1, Q5_1 only) | q
 * (the scales as w4_scale reads them: the file's float16, MXFP4's power of two as bfloat16)
 * q as Q4_K's lo area of one block for Q4_0, Q4_1 and MXFP4 (128 bytes), else one byte per
 * value (256 bytes, byte t * 32 + c * 4 + i for k = 4 t + i; Q8_0's int8 value + 128).
 * MXFP4's nibbles are its E2M1 codes, read through MXFP4_LUT (the doubled value + 12), and
 * its d the halved E8M0 scale (a power of two). A record is as wide as the file's block for
 * Q4_0, Q4_1 and Q8_0; MXFP4's is one byte wider (its scale in 16 bits), Q5_0's and Q5_1's
 * hold a byte a value. With I the block's sum of stored q * xq
 * (exact) and X the plain sum of its int8 activations:
 *
 *   J    = I - offset * X     (offset 8 for Q4_0, 16 for Q5_0, 128 for Q8_0, 12 for MXFP4,
 *                              else 0; exact)
 *   acc  = fmaf((float)J, d * xs, acc)
 *   mins = fmaf(m, xs * X, mins)      (Q4_1, Q5_1: w = d * q + m)
 *   y    = acc + mins (Q4_1, Q5_1) or acc (+ bias)
 *
 * |J| <= 32 * 128 * 127 < 2^24, so its float is exact; the same order in every variant and
 * in the oracle. The offset enters as the block's starting sum; AVX2 without VNNI multiplies
 * Q8_0's signed values directly (dot4x8_i8, as w8a8) and so starts from 0. */

/* Records of prefetch distance along a group's stream, about what the K-quants' run ahead. */
#define W4_B32_PREFETCH_BYTES 4864

static inline __attribute__((always_inline)) void w4_tile_b32(
    int64_t type, int has_m, const W4Act *a, int64_t r0, int R, int64_t k, const uint8_t *w,
    int64_t g0, int C, int64_t n, const float *bias, float *y, int64_t ny, int prefetch) {
    const int64_t nb = k / QBLOCK, rec = w4_record_bytes(type), qat = w4_b32_q_at(type);
    const int64_t ahead = W4_B32_PREFETCH_BYTES / rec, groups = (n + COLS - 1) / COLS;
    const int nibbles = w4_b32_nibbles(type);
    const int32_t offset = w4_b32_offset(type);
    const int INLINE_MINS = has_m && R * C <= 2;
    __m256 acc[W4_MAXR][W4_MAXC], mins[W4_MAXR][W4_MAXC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = mins[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rc[W4_MAXC];
        for (int c = 0; c < C; c++) rc[c] = w + ((g0 + c) * nb + b) * rec;
        if (prefetch && (g0 + C - 1) * nb + b + ahead < groups * nb)
            for (int c = 0; c < C; c++) prefetch_bytes(rc[c] + ahead * rec, rec);
        const int64_t at = b * QBLOCK;
        __m256i iacc[W4_MAXR][W4_MAXC];
        for (int r = 0; r < R; r++) {
            const int32_t x_sum = a->xsum[(r0 + r) * nb + b] / 128; /* X, exact */
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
            const __m256i start = _mm256_set1_epi32(-offset * x_sum);
#else
            const __m256i start = _mm256_set1_epi32(type == W4_Q8_0 ? 0 : -offset * x_sum);
#endif
            for (int c = 0; c < C; c++) iacc[r][c] = start;
        }
        const uint8_t *q[W4_MAXC];
        for (int c = 0; c < C; c++) q[c] = rc[c] + qat;
        w4_block_dots(iacc, q, nibbles, type == W4_Q8_0, w4_b32_lut(type), a, r0, R, C, k, at);
        for (int c = 0; c < C; c++) {
            const __m256 d = w4_scales8(type, rc[c]);
            for (int r = 0; r < R; r++) {
                const __m256 coef = _mm256_mul_ps(d, _mm256_set1_ps(a->xs[(r0 + r) * nb + b]));
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r][c]), coef, acc[r][c]);
            }
            if (INLINE_MINS) {
                const __m256 m = w4_scales8(type, rc[c] + 16);
                for (int r = 0; r < R; r++)
                    mins[r][c] = _mm256_fmadd_ps(
                        m, _mm256_set1_ps(a->xsx[(r0 + r) * nb + b]), mins[r][c]);
            }
        }
    }
    /* The m terms of larger tiles, in their own pass over the blocks (in order). */
    for (int c = 0; has_m && !INLINE_MINS && c < C; c++)
        for (int64_t b = 0; b < nb; b++) {
            const __m256 m = w4_scales8(type, w + ((g0 + c) * nb + b) * rec + 16);
            for (int r = 0; r < R; r++)
                mins[r][c] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->xsx[(r0 + r) * nb + b]),
                                             mins[r][c]);
        }
    for (int r = 0; has_m && r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_add_ps(acc[r][c], mins[r][c]);
    w4_store_tile(acc, R, C, r0, g0, n, bias, y, ny);
}

static void w4_tile_any(int64_t type, const W4Act *a, int64_t r0, int R, int64_t k,
                        const uint8_t *w, int64_t g0, int C, int64_t n, const float *bias,
                        float *y, int64_t ny, int prefetch) {
#define W4_CASE(TT, RR, CC)                                                                  \
    if (type == TT && R == RR && C == CC) {                                                  \
        w4_tile(TT, a, r0, RR, k, w, g0, CC, n, bias, y, ny, prefetch);                      \
        return;                                                                              \
    }
#define W4_B32_CASE(RR, CC)                                                                  \
    if (w4_is_b32(type) && R == RR && C == CC) { /* has_m constant: no unused registers */  \
        if (w4_b32_has_m(type))                                                              \
            w4_tile_b32(type, 1, a, r0, RR, k, w, g0, CC, n, bias, y, ny, prefetch);         \
        else                                                                                 \
            w4_tile_b32(type, 0, a, r0, RR, k, w, g0, CC, n, bias, y, ny, prefetch);         \
        return;                                                                              \
    }
    W4_B32_CASE(1, 1) W4_B32_CASE(1, 2) W4_B32_CASE(2, 1) W4_B32_CASE(2, 2)
    W4_B32_CASE(3, 1) W4_B32_CASE(4, 1)
    W4_CASE(W4_Q4K, 1, 1) W4_CASE(W4_Q4K, 1, 2) W4_CASE(W4_Q4K, 2, 1) W4_CASE(W4_Q4K, 2, 2)
    W4_CASE(W4_Q4K, 3, 1) W4_CASE(W4_Q4K, 4, 1)
    W4_CASE(W4_Q5K, 1, 1) W4_CASE(W4_Q5K, 1, 2) W4_CASE(W4_Q5K, 2, 1) W4_CASE(W4_Q5K, 2, 2)
    W4_CASE(W4_Q5K, 3, 1) W4_CASE(W4_Q5K, 4, 1)
    W4_CASE(W4_Q6K, 1, 1) W4_CASE(W4_Q6K, 1, 2) W4_CASE(W4_Q6K, 2, 1) W4_CASE(W4_Q6K, 2, 2)
    W4_CASE(W4_Q6K, 3, 1) W4_CASE(W4_Q6K, 4, 1)
#if W4_WIDE
    W4_CASE(W4_Q4K, 3, 2) W4_CASE(W4_Q4K, 4, 2) W4_CASE(W4_Q5K, 3, 2) W4_CASE(W4_Q5K, 4, 2)
    W4_CASE(W4_Q6K, 3, 2) W4_CASE(W4_Q6K, 4, 2)
    W4_CASE(W4_Q4K, 5, 2) W4_CASE(W4_Q4K, 6, 2) W4_CASE(W4_Q5K, 5, 2) W4_CASE(W4_Q5K, 6, 2)
    W4_CASE(W4_Q4K, 5, 1) W4_CASE(W4_Q4K, 6, 1) W4_CASE(W4_Q5K, 5, 1) W4_CASE(W4_Q5K, 6, 1)
    W4_B32_CASE(3, 2) W4_B32_CASE(4, 2) W4_B32_CASE(5, 2) W4_B32_CASE(6, 2) W4_B32_CASE(5, 1)
    W4_B32_CASE(6, 1)
#endif
#undef W4_B32_CASE
#undef W4_CASE
}

/* One segment of outputs [y0, y0 + n) of y (row stride ny): work items (pair of column
 * groups, row block) split statically over the threads. */
static void w4_segment_body(int64_t type, const W4Act *a, int64_t m, int64_t k,
                            const uint8_t *w, int64_t n, const float *bias, float *y,
                            int64_t ny) {
    const int64_t groups = (n + COLS - 1) / COLS, pairs = (groups + 1) / 2;
    const int64_t rows = m == 1 ? 1
                       : W4_WIDE && type != W4_Q6K ? W4_PREFILL_ROWS : 4;
    const int64_t blocks = (m + rows - 1) / rows;
    /* no barrier per segment: segments write their own columns (the caller waits once) */
#pragma omp for schedule(static) nowait
    for (int64_t task = 0; task < pairs * blocks; task++) {
        const int64_t g0 = task / blocks * 2, r0 = task % blocks * rows;
        const int R = m - r0 < rows ? (int)(m - r0) : (int)rows;
        const int C = g0 + 1 < groups ? 2 : 1;
        /* A call of one row block (decode) streams the weights from memory, and one
         * stream of consecutive records reads at up to twice the speed of two interleaved
         * ones (measured on 2 cores, 8192 x 2048 Q4_K: 1.6x at 1-2 rows, 1.27x at 4; Q6_K
         * at 4 rows is compute-bound and keeps the pair, 1.16x faster); 3-4 rows without
         * AVX-512VL go one group at a time to keep their accumulators in registers. */
        const int one_stream = m <= rows && (R <= 2 || type == W4_Q4K ||
                                             (w4_is_b32(type) && w4_b32_nibbles(type)));
        if (!one_stream && (R <= 2 || W4_WIDE)) {
            w4_tile_any(type, a, r0, R, k, w, g0, C, n, bias, y, ny, r0 == 0);
        } else {
            for (int c = 0; c < C; c++)
                w4_tile_any(type, a, r0, R, k, w, g0 + c, 1, n, bias, y, ny, r0 == 0);
        }
    }
}

static void w4_linear_segments_body(const W4Segments *segs, const W4Act *a, int64_t m,
                                    int64_t k, const float *bias, float *y) {
    int64_t ny = 0, y0 = 0;
    for (int64_t i = 0; i < segs->count; i++) ny += segs->columns[i];
    for (int64_t i = 0; i < segs->count; i++) {
        w4_segment_body(segs->types[i], a, m, k, segs->packed[i], segs->columns[i],
                        bias ? bias + y0 : NULL, y + y0, ny);
        y0 += segs->columns[i];
    }
#pragma omp barrier
}

/* y[m, sum of ns] = the w4a8 arithmetic of x [m, k] with `nseg` packed segments stacked
 * along the outputs (segment i: type types[i], ns[i] columns); bias over all columns or
 * NULL. Rows are independent: a row's result is the same bits in any call. */
LOOM_EXPORT void loom_linear_w4a8(const float *x, int64_t m, int64_t k, int64_t nseg,
                                  const int64_t *types, const uint8_t *const *packed,
                                  const int64_t *ns, const float *bias, float *y) {
    W4Segments segs; /* fields set one by one: a zeroing initialiser compiles to a 512-bit
                      * store on the AVX-512 build */
    segs.count = nseg < W4_MAX_SEGMENTS ? nseg : W4_MAX_SEGMENTS; /* the caller checks */
    for (int64_t i = 0; i < segs.count; i++)
        segs.types[i] = types[i], segs.packed[i] = packed[i], segs.columns[i] = ns[i];
    const W4Act a = quant_buffers(m, k);
#pragma omp parallel
    {
        w4_act_body(x, m, k, a);
        w4_linear_segments_body(&segs, &a, m, k, bias, y);
    }
    free_quant_buffers(a);
}

/* One b32 segment of the oracle below: y[r, o] (row stride ny) one output at a time. */
static void w4_b32_ref(int64_t type, const W4Act *a, int64_t m, int64_t k, const uint8_t *w,
                       int64_t n, const float *bias, float *y, int64_t ny) {
    const int64_t nb = k / QBLOCK, rec = w4_record_bytes(type), qat = w4_b32_q_at(type);
    for (int64_t r = 0; r < m; r++)
        for (int64_t o = 0; o < n; o++) {
            const int c = (int)(o % COLS);
            float acc = 0.0f, mins = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t ab = r * nb + b;
                const uint8_t *rc = w + ((o / COLS) * nb + b) * rec;
                const int8_t *xq = a->xq + r * k + b * QBLOCK;
                int32_t i32 = 0, x_sum = 0;
                for (int i = 0; i < 32; i++) {
                    const int q = w4_b32_value(
                        type, w4_b32_nibbles(type)
                                  ? (rc[qat + w4_lo_at(c, i)] >> w4_lo_shift(i)) & 15
                                  : rc[qat + w4_byte_at(c, i)]);
                    i32 += q * xq[i];
                    x_sum += xq[i];
                }
                const float d = w4_scale(type, rc, c);
                acc = fmaf((float)(i32 - w4_b32_offset(type) * x_sum), d * a->xs[ab], acc);
                if (w4_b32_has_m(type)) mins = fmaf(w4_scale(type, rc + 16, c), a->xsx[ab], mins);
            }
            const float v = w4_b32_has_m(type) ? acc + mins : acc;
            y[r * ny + o] = bias ? v + bias[o] : v;
        }
}

/* The w4a8 arithmetic one output at a time in plain C, from the packed records through
 * w4-independent accessors: the oracle of the tests. Same arguments as loom_linear_w4a8. */
LOOM_EXPORT void loom_linear_w4a8_ref(const float *x, int64_t m, int64_t k, int64_t nseg,
                                      const int64_t *types, const uint8_t *const *packed,
                                      const int64_t *ns, const float *bias, float *y) {
    int64_t ny = 0;
    for (int64_t i = 0; i < nseg; i++) ny += ns[i];
    const int64_t nb = k / QBLOCK, nsb = k / W4_SB;
    const W4Act a = quant_buffers(m, k);
    for (int64_t r = 0; r < m; r++) {
        quantize_row_q8_scalar(x + r * k, k, a.xq + r * k, a.xs + r * nb, a.xsum + r * nb);
        w4_act_finish_row(a, r, k);
    }
    int64_t y0 = 0;
    for (int64_t seg = 0; seg < nseg; seg++) {
        const int64_t type = types[seg], rec = w4_record_bytes(type);
        if (w4_is_b32(type)) {
            w4_b32_ref(type, &a, m, k, packed[seg], ns[seg], bias ? bias + y0 : NULL, y + y0,
                       ny);
            y0 += ns[seg];
            continue;
        }
        for (int64_t r = 0; r < m; r++)
            for (int64_t o = 0; o < ns[seg]; o++) {
                const int c = (int)(o % COLS);
                float acc = 0.0f, mins = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    const int64_t s = b / 8, j = b % 8, ab = r * nb + b;
                    const uint8_t *rc = packed[seg] + ((o / COLS) * nsb + s) * rec;
                    const int8_t *xq = a.xq + r * k + b * QBLOCK;
                    const float d = w4_scale(type, rc, c);
                    if (w4_has_mins(type)) {
                        int32_t i32 = 0;
                        for (int i = 0; i < 32; i++)
                            i32 += (type == W4_Q4K ? (rc[W4_KM_Q + j * 128 + w4_lo_at(c, i)] >>
                                                      w4_lo_shift(i)) & 15
                                                   : rc[W4_KM_Q + w4_byte_at(c, (int)(32 * j) + i)])
                                   * xq[i];
                        const float dmin = w4_scale(type, rc + W4_KM_DMIN, c);
                        const float ds = d * (float)rc[W4_KM_SC + j * 8 + c];
                        acc = fmaf((float)i32, ds * a.xs[ab], acc);
                        mins = fmaf(dmin * (float)rc[W4_KM_M + j * 8 + c], a.xsx[ab], mins);
                    } else {
                        int32_t half[2] = {0, 0};
                        for (int i = 0; i < 32; i++)
                            half[i / 16] += w4_q6k_value(rc, c, (int)(32 * j) + i) * xq[i];
                        const int32_t sa = (int8_t)rc[W4_Q6_SC + (2 * j) * 8 + c];
                        const int32_t sb = (int8_t)rc[W4_Q6_SC + (2 * j + 1) * 8 + c];
                        const int32_t jj = sa * (half[0] - 32 * a.x16[2 * ab]) +
                                           sb * (half[1] - 32 * a.x16[2 * ab + 1]);
                        acc = fmaf((float)jj, d * a.xs[ab], acc);
                    }
                }
                const float v = acc - mins;
                y[r * ny + y0 + o] = bias ? v + bias[y0 + o] : v;
            }
        y0 += ns[seg];
    }
    free_quant_buffers(a);
}

/* Kind 3 of the fused decoder's linear layers: quantise the rows, then every segment. */
static void w4_linear_kind3_body(const void *segments, const float *x, int64_t m, int64_t k,
                                 const float *bias, float *y, const QuantBuffers *q) {
    w4_act_body(x, m, k, *q);
    w4_linear_segments_body((const W4Segments *)segments, q, m, k, bias, y);
}

/* out[i, :] = row ids[i] of a packed [n, k] tensor, as the file's values (the embedding
 * lookup of a table kept packed). Returns 0, or -1 for an unknown type or an id outside
 * [0, n). */
LOOM_EXPORT int64_t loom_w4a8_rows(int64_t type, const uint8_t *packed, int64_t n, int64_t k,
                                   const int64_t *ids, int64_t count, float *out) {
    const int64_t rec = w4_record_bytes(type), rk = w4_record_k(type);
    if (rec < 0 || k % rk) return -1;
    const int64_t nsb = k / rk;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n) return -1;
    for (int64_t i = 0; i < count; i++)
        for (int64_t s = 0; s < nsb; s++) {
            const uint8_t *r = packed + ((ids[i] / COLS) * nsb + s) * rec;
            for (int kk = 0; kk < rk; kk++)
                out[i * k + s * rk + kk] = w4_weight(type, r, (int)(ids[i] % COLS), kk);
        }
    return 0;
}
