/* float32 weights, small batches.
 * A part of cpu_kernels.c's one translation unit: it may use what common.h and the parts
 * included before it define. */

/* ---- float32 weights: small batches, where BLAS repacks the whole weight every call ---- */

/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), float32, w row-major [n, k]. One code path
 * for every m (four weight rows at a time, each x row in turn while the rows sit in cache),
 * so a row's result never depends on the batch. */
static void f32_body(const float *x, int64_t m, int64_t k, const float *w, const float *bias,
                     int64_t n, float *y) {
    const int64_t quads = n / 4;
    const int64_t k16 = k - k % 16;
#pragma omp for schedule(static)
    for (int64_t qd = 0; qd < quads; qd++) {
        const int64_t row = qd * 4;
        const float *wr = w + row * k;
        if (qd + PREFETCH_QUADS < quads)
            prefetch_bytes(wr + PREFETCH_QUADS * 4 * k, 4 * k * (int64_t)sizeof(float));
        for (int64_t r = 0; r < m; r++) {
            const float *xr = x + r * k;
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t j = 0; j < k16; j += 16) {
                const __m256 x0 = _mm256_loadu_ps(xr + j), x1 = _mm256_loadu_ps(xr + j + 8);
                for (int i = 0; i < 4; i++) {
                    acc[2 * i] = _mm256_fmadd_ps(_mm256_loadu_ps(wr + i * k + j), x0, acc[2 * i]);
                    acc[2 * i + 1] =
                        _mm256_fmadd_ps(_mm256_loadu_ps(wr + i * k + j + 8), x1, acc[2 * i + 1]);
                }
            }
            for (int i = 0; i < 4; i++) {
                float s = hsum256(_mm256_add_ps(acc[2 * i], acc[2 * i + 1]));
                for (int64_t t = k16; t < k; t++) s += wr[i * k + t] * xr[t];
                y[r * n + row + i] = bias ? s + bias[row + i] : s;
            }
        }
    }
#pragma omp single
    for (int64_t row = quads * 4; row < n; row++)
        for (int64_t r = 0; r < m; r++) {
            float s = 0.0f;
            for (int64_t t = 0; t < k; t++) s += w[row * k + t] * x[r * k + t];
            y[r * n + row] = bias ? s + bias[row] : s;
        }
}

LOOM_EXPORT void loom_linear_f32(const float *x, int64_t m, int64_t k, const float *w,
                                 const float *bias, int64_t n, float *y) {
#pragma omp parallel
    f32_body(x, m, k, w, bias, n, y);
}
