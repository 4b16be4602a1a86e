/* RMSNorm (with residual), rotary embedding, the build's variant name.
 * A part of cpu_kernels.c's one translation unit: it may use what common.h and the parts
 * included before it define. */

/* out[r] = residual[r] + x[r] / rms(x[r]) * (w + offset), per row r of [rows, dim];
 * residual may be NULL (then nothing is added). offset is 1 for Gemma's (1 + w) weights and
 * 0 otherwise. Sums in float32, as torch computes the mean of squares. */
static void rms_norm_body(const float *x, int64_t rows, int64_t dim, const float *w,
                          float offset, float eps, const float *residual, float *out) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        __m256 acc = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= dim; j += 8) {
            __m256 v = _mm256_loadu_ps(xr + j);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum256(acc);
        for (; j < dim; j++) ss += xr[j] * xr[j];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        float *o = out + r * dim;
        const float *res = residual ? residual + r * dim : NULL;
        for (j = 0; j < dim; j++) {
            float v = (xr[j] * inv) * (w[j] + offset);
            o[j] = res ? res[j] + v : v;
        }
    }
}

LOOM_EXPORT void loom_rms_norm(const float *x, int64_t rows, int64_t dim, const float *w,
                               float offset, float eps, const float *residual, float *out) {
#pragma omp parallel if (rows > 8)
    rms_norm_body(x, rows, dim, w, offset, eps, residual, out);
}

/* Rotate-half rotary embedding: out[t, h, :] from x[t, h, :] (x and out [tokens, heads, d]),
 * with cos/sin tables [tokens, d]: out = x * cos + rotate_half(x) * sin, where
 * rotate_half(x) = (-x[d/2:], x[:d/2]). */
static void rope_body(const float *x, int64_t tokens, int64_t heads, int64_t d,
                      const float *cos_t, const float *sin_t, float *out) {
    const int64_t half = d / 2;
#pragma omp for schedule(static)
    for (int64_t th = 0; th < tokens * heads; th++) {
        const int64_t t = th / heads;
        const float *xv = x + th * d, *c = cos_t + t * d, *s = sin_t + t * d;
        float *o = out + th * d;
        for (int64_t j = 0; j < half; j++) {
            o[j] = xv[j] * c[j] - xv[j + half] * s[j];
            o[j + half] = xv[j + half] * c[j + half] + xv[j] * s[j + half];
        }
    }
}

LOOM_EXPORT void loom_rope_neox(const float *x, int64_t tokens, int64_t heads, int64_t d,
                                const float *cos_t, const float *sin_t, float *out) {
#pragma omp parallel if (tokens * heads > 64)
    rope_body(x, tokens, heads, d, cos_t, sin_t, out);
}

/* The variant this library was built as (loom/kernels/build.py names them the same). */
LOOM_EXPORT const char *loom_kernel_variant(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "avx512-vnni";
#elif defined(__AVXVNNI__)
    return "avx2-vnni";
#else
    return "avx2";
#endif
}
