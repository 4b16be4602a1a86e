/* The headers and the vector helpers every kernel shares.
 * A part of cpu_kernels.c's one translation unit: it may use what common.h and the parts
 * included before it define. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LOOM_EXPORT __attribute__((visibility("default")))

static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* 8 int8 weights at w -> 8 floats. */
static inline __m256 load8_i8(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}
