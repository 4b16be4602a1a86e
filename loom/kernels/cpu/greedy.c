/* Greedy sampling: argmax and log-sum-exp per row.
 * A part of cpu_kernels.c's one translation unit: it may use what common.h and the parts
 * included before it define. */

/* ---- greedy sampling: argmax and log-sum-exp of each logits row, in one read ---- */

#define LSE_CHUNK 16384

/* idx[r] = first index of the largest x[r, :], lse[r] = log(sum(exp(x[r, :]))), x [rows, v].
 * Rows are split into chunks of LSE_CHUNK spread over the threads, then merged in order. */
LOOM_EXPORT void loom_argmax_logsumexp(const float *x, int64_t rows, int64_t v, int64_t *idx,
                                       float *lse) {
    const int64_t chunks = (v + LSE_CHUNK - 1) / LSE_CHUNK;
    const int64_t tasks = rows * chunks;
    float *cmax = (float *)malloc((size_t)tasks * sizeof(float));
    float *csum = (float *)malloc((size_t)tasks * sizeof(float));
    int64_t *carg = (int64_t *)malloc((size_t)tasks * sizeof(int64_t));
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t r = t / chunks, c = t % chunks;
            const int64_t lo = c * LSE_CHUNK, hi = lo + LSE_CHUNK < v ? lo + LSE_CHUNK : v;
            const float *xr = x + r * v;
            float mx = -INFINITY;
            int64_t arg = lo;
            for (int64_t j = lo; j < hi; j++)
                if (xr[j] > mx) mx = xr[j], arg = j;
            __m256 acc = _mm256_setzero_ps();
            const __m256 vmx = _mm256_set1_ps(mx);
            int64_t j = lo;
            for (; j + 8 <= hi; j += 8)
                acc = _mm256_add_ps(acc, exp256(_mm256_sub_ps(_mm256_loadu_ps(xr + j), vmx)));
            float sum = hsum256(acc);
            for (; j < hi; j++) sum += expf(xr[j] - mx);
            cmax[t] = mx, csum[t] = sum, carg[t] = arg;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            float mx = -INFINITY;
            int64_t arg = 0;
            for (int64_t c = 0; c < chunks; c++)
                if (cmax[r * chunks + c] > mx) mx = cmax[r * chunks + c], arg = carg[r * chunks + c];
            float sum = 0.0f;
            for (int64_t c = 0; c < chunks; c++)
                sum += csum[r * chunks + c] * expf(cmax[r * chunks + c] - mx);
            idx[r] = arg;
            lse[r] = mx + logf(sum);
        }
    }
    free(cmax), free(csum), free(carg);
}
