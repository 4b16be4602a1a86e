/* int8 weights x float32 activations, small batches.
 * A part of cpu_kernels.c's one translation unit: it may use what common.h and the parts
 * included before it define. */

/* out[i] = dot(w_i, x) for 4 consecutive int8 rows w_0..w_3 (stride k) and one float row x.
 * Eight independent accumulators hide the FMA latency; each weight is converted once. */
static void dot4_i8_x1(const int8_t *w, const float *x, int64_t k, float out[4]) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= k; j += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + j), x1 = _mm256_loadu_ps(x + j + 8);
        for (int i = 0; i < 4; i++) {
            acc[2 * i] = _mm256_fmadd_ps(load8_i8(w + i * k + j), x0, acc[2 * i]);
            acc[2 * i + 1] = _mm256_fmadd_ps(load8_i8(w + i * k + j + 8), x1, acc[2 * i + 1]);
        }
    }
    for (int i = 0; i < 4; i++) {
        float s = hsum256(_mm256_add_ps(acc[2 * i], acc[2 * i + 1]));
        for (int64_t t = j; t < k; t++) s += (float)w[i * k + t] * x[t];
        out[i] = s;
    }
}

/* Rows of the k-chunk a weight tile holds, converted to float once and reused for all m. */
#define TILE_K 512

/* How many 4-row groups ahead of the current one are prefetched. */
#ifndef PREFETCH_QUADS
#define PREFETCH_QUADS 4
#endif

/* Streams from DRAM run at about half the bandwidth without a software prefetch of the rows a
 * few groups ahead: bring `bytes` bytes from `start` towards the cache, a line at a time. */
static inline void prefetch_bytes(const void *start, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64)
        _mm_prefetch((const char *)start + off, _MM_HINT_T0);
}

/* acc[r][i][0..1] += the products of tile row i and x row r over one k-chunk (kc a multiple of
 * 16), split exactly as dot4_i8_x1 splits them, so m == 1 and m > 1 sum in the same order. */
static void tile4_accumulate(const float *tile, int64_t kc, const float *x, int64_t k,
                             int64_t m, __m256 *acc) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * k;
        __m256 *a = acc + r * 8;
        __m256 a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3], a4 = a[4], a5 = a[5], a6 = a[6],
               a7 = a[7];
        for (int64_t j = 0; j < kc; j += 16) {
            const __m256 x0 = _mm256_loadu_ps(xr + j), x1 = _mm256_loadu_ps(xr + j + 8);
            a0 = _mm256_fmadd_ps(_mm256_load_ps(tile + j), x0, a0);
            a1 = _mm256_fmadd_ps(_mm256_load_ps(tile + j + 8), x1, a1);
            a2 = _mm256_fmadd_ps(_mm256_load_ps(tile + TILE_K + j), x0, a2);
            a3 = _mm256_fmadd_ps(_mm256_load_ps(tile + TILE_K + j + 8), x1, a3);
            a4 = _mm256_fmadd_ps(_mm256_load_ps(tile + 2 * TILE_K + j), x0, a4);
            a5 = _mm256_fmadd_ps(_mm256_load_ps(tile + 2 * TILE_K + j + 8), x1, a5);
            a6 = _mm256_fmadd_ps(_mm256_load_ps(tile + 3 * TILE_K + j), x0, a6);
            a7 = _mm256_fmadd_ps(_mm256_load_ps(tile + 3 * TILE_K + j + 8), x1, a7);
        }
        a[0] = a0, a[1] = a1, a[2] = a2, a[3] = a3, a[4] = a4, a[5] = a5, a[6] = a6, a[7] = a7;
    }
}

/* y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]): weight-only int8 linear.
 * x [m, k] float32, w [n, k] int8 row-major, scale [n] float32, bias [n] or NULL, y [m, n].
 * Every (x row, weight row) sum runs in the same order whether m == 1 (fused path) or m > 1
 * (tiled path), so a row's result does not depend on the rest of the batch. */
static void w8_body(const float *x, int64_t m, int64_t k, const int8_t *w, const float *scale,
                    const float *bias, int64_t n, float *y) {
    const int64_t quads = n / 4;
    const int64_t k16 = k - k % 16; /* the vectorised part; the tail is summed last */
    {
        float tile[4 * TILE_K] __attribute__((aligned(32)));
        float sums[4];
        __m256 *acc = (__m256 *)aligned_alloc(32, (size_t)(m > 1 ? m : 1) * 8 * sizeof(__m256));
#pragma omp for schedule(static)
        for (int64_t qd = 0; qd < quads; qd++) {
            const int64_t row = qd * 4;
            const int8_t *wr = w + row * k;
            if (qd + PREFETCH_QUADS < quads) prefetch_bytes(wr + PREFETCH_QUADS * 4 * k, 4 * k);
            if (m == 1) {
                dot4_i8_x1(wr, x, k, sums);
                for (int i = 0; i < 4; i++) {
                    float v = sums[i] * scale[row + i];
                    y[row + i] = bias ? v + bias[row + i] : v;
                }
                continue;
            }
            for (int64_t t = 0; t < m * 8; t++) acc[t] = _mm256_setzero_ps();
            for (int64_t k0 = 0; k0 < k16; k0 += TILE_K) {
                const int64_t kc = k16 - k0 < TILE_K ? k16 - k0 : TILE_K;
                for (int i = 0; i < 4; i++)
                    for (int64_t j = 0; j < kc; j += 8)
                        _mm256_store_ps(tile + i * TILE_K + j, load8_i8(wr + i * k + k0 + j));
                tile4_accumulate(tile, kc, x + k0, k, m, acc);
            }
            for (int64_t r = 0; r < m; r++)
                for (int i = 0; i < 4; i++) {
                    float v = hsum256(_mm256_add_ps(acc[r * 8 + 2 * i], acc[r * 8 + 2 * i + 1]));
                    for (int64_t t = k16; t < k; t++) v += (float)wr[i * k + t] * x[r * k + t];
                    v *= scale[row + i];
                    y[r * n + row + i] = bias ? v + bias[row + i] : v;
                }
        }
        free(acc);
    }
    /* The last n % 4 rows, one at a time. */
#pragma omp single
    for (int64_t row = quads * 4; row < n; row++)
        for (int64_t r = 0; r < m; r++) {
            float s = 0.0f;
            for (int64_t t = 0; t < k; t++) s += (float)w[row * k + t] * x[r * k + t];
            s *= scale[row];
            y[r * n + row] = bias ? s + bias[row] : s;
        }
}

LOOM_EXPORT void loom_linear_w8(const float *x, int64_t m, int64_t k, const int8_t *w,
                                const float *scale, const float *bias, int64_t n, float *y) {
#pragma omp parallel
    w8_body(x, m, k, w, scale, bias, n, y);
}
