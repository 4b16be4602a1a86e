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
 * wrapper that opens that region. The fused decoder (end of file) runs a whole step's layers
 * inside one region: waking sleeping threads for every small operation costs more than the
 * operation itself on a decode step.
 */
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

static inline void axpy_f32(float alpha, const float *x, float *y, int64_t d) {
    __m256 a = _mm256_set1_ps(alpha);
    int64_t j = 0;
    for (; j + 8 <= d; j += 8)
        _mm256_storeu_ps(y + j, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + j), _mm256_loadu_ps(y + j)));
    for (; j < d; j++) y[j] += alpha * x[j];
}

/* The KV cache holds float32 or float16 (f16 != 0) elements; these read element j of a row
 * (eight of them from j) as float32. */
static inline __m256 load_kv8(const void *row, int64_t j, int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + j)))
               : _mm256_loadu_ps((const float *)row + j);
}

static inline float load_kv1(const void *row, int64_t j, int f16) {
    return f16 ? _cvtsh_ss(((const uint16_t *)row)[j]) : ((const float *)row)[j];
}

/* Write n float32 values as a cache row (rounded to nearest even for float16). */
static inline void store_kv_row(void *row, const float *src, int64_t n, int f16) {
    if (!f16) {
        memcpy(row, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *dst = (uint16_t *)row;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(dst + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
    for (; j < n; j++) dst[j] = _cvtss_sh(src[j], _MM_FROUND_TO_NEAREST_INT);
}

/* out[g] = dot(q + g * d, key) for the ng <= 8 query heads that share one key vector: the
 * key is loaded once per 16 floats and four heads accumulate at a time in independent
 * registers (a single dot product is bound by the latency of its own additions). */
static inline void dots_shared_key(const float *q, int64_t ng, const void *key, int64_t d,
                                   int f16, float *out) {
    for (int64_t g0 = 0; g0 < ng; g0 += 4) {
        const int64_t n4 = ng - g0 < 4 ? ng - g0 : 4;
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 16 <= d; j += 16) {
            const __m256 k0 = load_kv8(key, j, f16), k1 = load_kv8(key, j + 8, f16);
            for (int64_t g = 0; g < n4; g++) {
                const float *qg = q + (g0 + g) * d + j;
                acc[2 * g] = _mm256_fmadd_ps(_mm256_loadu_ps(qg), k0, acc[2 * g]);
                acc[2 * g + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8), k1, acc[2 * g + 1]);
            }
        }
        for (int64_t g = 0; g < n4; g++) {
            float sum = hsum256(_mm256_add_ps(acc[2 * g], acc[2 * g + 1]));
            for (int64_t t = j; t < d; t++) sum += q[(g0 + g) * d + t] * load_kv1(key, t, f16);
            out[g0 + g] = sum;
        }
    }
}

/* dots_shared_key for two keys at once: out0[g] and out1[g] are summed exactly as
 * dots_shared_key sums them (two 8-lane accumulators per dot over d in steps of 16, hsum,
 * then the tail in order); sharing each loaded query vector between two keys halves the
 * loads per multiply-add. 16 accumulators: for CPUs with 32 vector registers. */
static inline void dots_two_keys(const float *q, int64_t ng, const void *key0, const void *key1,
                                 int64_t d, int f16, float *out0, float *out1) {
    for (int64_t g0 = 0; g0 < ng; g0 += 4) {
        const int64_t n4 = ng - g0 < 4 ? ng - g0 : 4;
        __m256 a[8], b[8];
        for (int i = 0; i < 8; i++) a[i] = b[i] = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 16 <= d; j += 16) {
            const __m256 k00 = load_kv8(key0, j, f16), k01 = load_kv8(key0, j + 8, f16);
            const __m256 k10 = load_kv8(key1, j, f16), k11 = load_kv8(key1, j + 8, f16);
            for (int64_t g = 0; g < n4; g++) {
                const float *qg = q + (g0 + g) * d + j;
                const __m256 q0 = _mm256_loadu_ps(qg), q1 = _mm256_loadu_ps(qg + 8);
                a[2 * g] = _mm256_fmadd_ps(q0, k00, a[2 * g]);
                a[2 * g + 1] = _mm256_fmadd_ps(q1, k01, a[2 * g + 1]);
                b[2 * g] = _mm256_fmadd_ps(q0, k10, b[2 * g]);
                b[2 * g + 1] = _mm256_fmadd_ps(q1, k11, b[2 * g + 1]);
            }
        }
        for (int64_t g = 0; g < n4; g++) {
            float s0 = hsum256(_mm256_add_ps(a[2 * g], a[2 * g + 1]));
            float s1 = hsum256(_mm256_add_ps(b[2 * g], b[2 * g + 1]));
            for (int64_t t = j; t < d; t++) {
                s0 += q[(g0 + g) * d + t] * load_kv1(key0, t, f16);
                s1 += q[(g0 + g) * d + t] * load_kv1(key1, t, f16);
            }
            out0[g0 + g] = s0;
            out1[g0 + g] = s1;
        }
    }
}

/* exp of 8 floats: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor
 * polynomial (relative error below 2e-7 on that interval), scaled by 2^n. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln2, with ln2 split in two parts so the subtraction stays exact. */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* Keys per part of paged attention: a sequence's keys are split at absolute positions that
 * are multiples of this, each part is attended on its own and the parts are merged with the
 * usual max/sum rescaling, in part order. */
#define ATTN_PART 128
/* Query heads per kv head handled in one pass; larger groups loop over slices of this size. */
#define ATTN_MAX_GROUP 8
/* Keys per block of the score pass (and how far ahead its K rows are prefetched). */
#define ATTN_KEY_BLOCK 16
/* Query tokens of one sequence per work unit. */
#define ATTN_UNIT 16
/* Units of at least this many tokens convert a part's float16 K/V rows to float32 once
 * (exact) instead of once per query token. */
#define ATTN_CONVERT_MIN 4
/* Keys per pass of the score loop and floats per value chunk: more where the CPU has 32
 * vector registers (AVX-512VL) to hold the accumulators. Neither changes any sum's order. */
#if defined(__AVX512VL__)
#define ATTN_KEYS_PER_PASS 2
#define ATTN_VALUE_CHUNK 32
#else
#define ATTN_KEYS_PER_PASS 1
#define ATTN_VALUE_CHUNK 16
#endif
/* Bound on the merge scratch (floats): the step's tokens are attended in windows of units
 * whose per-part results fit in it. */
#define ATTN_SCRATCH_BUDGET (16 * 1024 * 1024)

/* The work of one attention call, the same for every layer of a step: the query tokens cut
 * into units (at most ATTN_UNIT consecutive tokens of one sequence), and the units grouped
 * into windows whose merge scratch fits the budget. */
typedef struct {
    int64_t windows, parts;
    int64_t *unit_seq, *unit_t0, *unit_t1; /* per unit: sequence, token range [t0, t1) */
    int64_t *window_unit;                  /* [windows + 1]: units of window w */
    /* [windows]: within window w its units of several tokens come first, those of one token
     * (decode rows) from window_single[w] on */
    int64_t *window_single;
    int64_t *window_tok; /* [windows + 1]: window w holds query tokens [tok[w], tok[w + 1]) */
    float *merge; /* widest window's tokens x h x parts x (d + 2): each part's output, max, sum */
    float *local; /* per thread: scores, a key block's converted K rows, a part's V rows */
    int64_t local_floats;
} AttnPlan;

static AttnPlan attn_plan(const int64_t *q_start, int64_t s, int64_t h, int64_t d,
                          int64_t max_len) {
    AttnPlan p;
    p.parts = max_len > 0 ? (max_len + ATTN_PART - 1) / ATTN_PART : 1;
    const int64_t per_token = h * p.parts * (d + 2);
    int64_t cap = ATTN_SCRATCH_BUDGET / per_token;
    cap = cap < ATTN_UNIT ? ATTN_UNIT : cap;
    int64_t units = 0;
    for (int64_t i = 0; i < s; i++)
        units += (q_start[i + 1] - q_start[i] + ATTN_UNIT - 1) / ATTN_UNIT;
    /* units, and windows <= units */
    p.unit_seq = (int64_t *)malloc((size_t)(3 * units + 3 * (units + 1)) * sizeof(int64_t));
    p.unit_t0 = p.unit_seq + units;
    p.unit_t1 = p.unit_t0 + units;
    p.window_unit = p.unit_t1 + units;
    p.window_single = p.window_unit + units + 1;
    p.window_tok = p.window_single + units + 1;
    int64_t u = 0, windows = 0, in_window = 0, widest = 0;
    p.window_unit[0] = 0;
    for (int64_t i = 0; i < s; i++)
        for (int64_t t = q_start[i]; t < q_start[i + 1]; t += ATTN_UNIT, u++) {
            const int64_t t1 = t + ATTN_UNIT < q_start[i + 1] ? t + ATTN_UNIT : q_start[i + 1];
            if (in_window > 0 && in_window + (t1 - t) > cap) {
                p.window_unit[++windows] = u;
                in_window = 0;
            }
            p.unit_seq[u] = i, p.unit_t0[u] = t, p.unit_t1[u] = t1;
            in_window += t1 - t;
            widest = in_window > widest ? in_window : widest;
        }
    p.windows = units > 0 ? windows + 1 : 0;
    p.window_unit[p.windows] = units;
    for (int64_t w = 0; w < p.windows; w++) p.window_tok[w] = p.unit_t0[p.window_unit[w]];
    p.window_tok[p.windows] = units > 0 ? p.unit_t1[units - 1] : 0;
    /* Order each window's units: several tokens first, then single ones (stable; a unit's
     * merge slots follow from its tokens, not from its place). */
    for (int64_t w = 0; w < p.windows; w++) {
        int64_t at = p.window_unit[w];
        for (int64_t v = at; v < p.window_unit[w + 1]; v++) {
            if (p.unit_t1[v] - p.unit_t0[v] == 1) continue;
            /* move unit v to slot `at` (at <= v): rotate [at, v] right by one */
            const int64_t sq = p.unit_seq[v], t0 = p.unit_t0[v], t1 = p.unit_t1[v];
            for (int64_t x = v; x > at; x--)
                p.unit_seq[x] = p.unit_seq[x - 1], p.unit_t0[x] = p.unit_t0[x - 1],
                p.unit_t1[x] = p.unit_t1[x - 1];
            p.unit_seq[at] = sq, p.unit_t0[at] = t0, p.unit_t1[at] = t1;
            at++;
        }
        p.window_single[w] = at;
    }
    p.merge = (float *)malloc((size_t)(widest * per_token + 1) * sizeof(float));
    p.local_floats = ATTN_UNIT * ATTN_MAX_GROUP * ATTN_PART + (ATTN_PART + ATTN_KEY_BLOCK) * d;
    p.local = (float *)malloc((size_t)(omp_get_max_threads() * p.local_floats) * sizeof(float));
    return p;
}

static void free_attn_plan(AttnPlan p) {
    free(p.unit_seq), free(p.merge), free(p.local);
}

/* Read n float16 or float32 cache elements as float32 (exact). */
static inline void kv_row_to_f32(const void *row, int64_t n, int f16, float *out) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, load_kv8(row, j, f16));
    for (; j < n; j++) out[j] = load_kv1(row, j, f16);
}

/* A part's softmax numerators in place: scores sl[0, nk) -> exp(score - mx) (masked keys,
 * -inf: exactly 0; no finite score at all, mx = -inf: every weight 0), padded with masked
 * scores to a multiple of 8 (<= ATTN_PART) so that the sum has one shape whatever nk is: 8
 * lanes by key index, then hsum. Returns the sum. Every attention path uses this one. */
static inline float softmax_numerators(float *sl, int64_t nk, float mx) {
    if (mx == -INFINITY) {
        memset(sl, 0, (size_t)nk * sizeof(float));
        return 0.0f;
    }
    const int64_t nk8 = (nk + 7) / 8 * 8;
    for (int64_t p = nk; p < nk8; p++) sl[p] = -INFINITY;
    const __m256 vmx = _mm256_set1_ps(mx), ninf = _mm256_set1_ps(-INFINITY);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t p = 0; p < nk8; p += 8) {
        const __m256 s8 = _mm256_loadu_ps(sl + p);
        const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(s8, vmx)),
                                       _mm256_cmp_ps(s8, ninf, _CMP_NEQ_OQ));
        _mm256_storeu_ps(sl + p, e);
        acc = _mm256_add_ps(acc, e);
    }
    return hsum256(acc);
}

/* Phase 1 for one work item: the query tokens [ta, tb) of sequence seq (positions pos_a ..),
 * query heads h0 .. h0 + ng of kv head kvh, keys of one part, into the merge slots.
 *
 * The arithmetic of a (query, head, part) result depends on nothing but the query, its
 * position and the part's keys: scores in key order, their max, exp(score - max) summed in 8
 * lanes by key index within the part, and each output element summed over the keys in order.
 * Keys a query cannot see contribute exact zeros and are skipped; so the unit, the window, the
 * chunk and the batch a query is computed in never change its bits. */
static inline __attribute__((always_inline)) void attend_part(
    const float *q, int64_t ta, int64_t tb, int64_t pos_a, int64_t len, const void *k_cache,
    const void *v_cache, const int64_t *table, int64_t h, int64_t hkv, int64_t kvh, int64_t h0,
    int64_t ng, int64_t d, int64_t bs, int64_t window, float scale, float softcap,
    int64_t part, int64_t parts, float *merge_base, float *local, int f16) {
    const int64_t row_bytes = d * (f16 ? 2 : 4), ql = tb - ta, pos_b = pos_a + ql - 1;
    const int64_t slot_floats = d + 2;
    const int64_t lo = (window > 0 && pos_a - window + 1 > 0) ? pos_a - window + 1 : 0;
    const int64_t k0 = lo / ATTN_PART * ATTN_PART + part * ATTN_PART;
    /* Keys past the unit's last query are masked for all of its queries. */
    const int64_t k_end = pos_b + 1 < len ? pos_b + 1 : len;
    const int64_t k1 = k0 + ATTN_PART < k_end ? k0 + ATTN_PART : k_end;
    const int64_t kv0 = k0 > lo ? k0 : lo, nk = k1 - k0;
#define RES(t, g) (merge_base + (((t) * h + h0 + (g)) * parts + part) * slot_floats)
    for (int64_t t = 0; t < ql; t++)
        for (int64_t g = 0; g < ng; g++) {
            RES(t, g)[d] = -INFINITY;
            RES(t, g)[d + 1] = 0.0f;
        }
    if (nk <= 0 || kv0 >= k1) return; /* no key of this part is visible to the unit */
    float *scores = local; /* [ql][ng][ATTN_PART] */
    float *krow = local + ATTN_UNIT * ATTN_MAX_GROUP * ATTN_PART;
    float *vconv = krow + ATTN_KEY_BLOCK * d; /* [ATTN_PART][d] when converting */
    const int convert = f16 && ql >= ATTN_CONVERT_MIN;
#define SC(t, g) (scores + ((t) * ATTN_MAX_GROUP + (g)) * ATTN_PART)
    const char *vrows[ATTN_PART];
    for (int64_t t = 0; t < ql; t++)
        for (int64_t g = 0; g < ng; g++)
            for (int64_t p = k0; p < kv0; p++) SC(t, g)[p - k0] = -INFINITY;
    /* Scores, in blocks of ATTN_KEY_BLOCK keys: a block's keys (and each query token's rows)
     * stay in L1 while every query token of the unit meets them, one or two keys per pass (a
     * masked one of a pair is computed, then overwritten). */
    for (int64_t pb = kv0; pb < k1; pb += ATTN_KEY_BLOCK) {
        const int64_t pe = pb + ATTN_KEY_BLOCK < k1 ? pb + ATTN_KEY_BLOCK : k1;
        const void *key[ATTN_KEY_BLOCK];
        for (int64_t p = pb; p < pe; p++) {
            const int64_t slot = (table[p / bs] * bs + p % bs) * hkv + kvh;
            const char *kv = (const char *)k_cache + slot * row_bytes;
            vrows[p - k0] = (const char *)v_cache + slot * row_bytes;
            prefetch_bytes(vrows[p - k0], row_bytes);
            const int64_t pf = p + ATTN_KEY_BLOCK;
            if (pf < k1)
                prefetch_bytes((const char *)k_cache +
                                   ((table[pf / bs] * bs + pf % bs) * hkv + kvh) * row_bytes,
                               row_bytes);
            key[p - pb] = kv;
            if (convert) {
                kv_row_to_f32(kv, d, f16, krow + (p - pb) * d);
                key[p - pb] = krow + (p - pb) * d;
            }
        }
        const int key_f16 = convert ? 0 : f16;
        for (int64_t t = 0; t < ql; t++) {
            const int64_t pos = pos_a + t;
            const float *qt = q + ((ta + t) * h + h0) * d;
            for (int64_t p = pb; p < pe;) {
                const int64_t npass = ATTN_KEYS_PER_PASS == 2 && p + 1 < pe ? 2 : 1;
                int visible[2];
                for (int64_t i = 0; i < npass; i++)
                    visible[i] = !(p + i > pos || (window > 0 && p + i <= pos - window));
                if (!visible[0] && (npass == 1 || !visible[1])) {
                    for (int64_t i = 0; i < npass; i++)
                        for (int64_t g = 0; g < ng; g++) SC(t, g)[p + i - k0] = -INFINITY;
                    p += npass;
                    continue;
                }
                float dots[2][ATTN_MAX_GROUP];
                if (npass == 2)
                    dots_two_keys(qt, ng, key[p - pb], key[p + 1 - pb], d, key_f16, dots[0],
                                  dots[1]);
                else
                    dots_shared_key(qt, ng, key[p - pb], d, key_f16, dots[0]);
                for (int64_t i = 0; i < npass; i++)
                    for (int64_t g = 0; g < ng; g++) {
                        float *sc_at = SC(t, g) + (p + i - k0);
                        if (!visible[i]) {
                            *sc_at = -INFINITY;
                            continue;
                        }
                        float sc = dots[i][g] * scale;
                        if (softcap > 0.0f) sc = softcap * tanhf(sc / softcap);
                        *sc_at = sc;
                        if (sc > RES(t, g)[d]) RES(t, g)[d] = sc;
                    }
                p += npass;
            }
        }
    }
    /* Softmax numerators in place, and their sums. */
    for (int64_t t = 0; t < ql; t++)
        for (int64_t g = 0; g < ng; g++)
            RES(t, g)[d + 1] = softmax_numerators(SC(t, g), nk, RES(t, g)[d]);
    if (convert)
        for (int64_t p = kv0 - k0; p < nk; p++) {
            kv_row_to_f32(vrows[p], d, f16, vconv + p * d);
            vrows[p] = (const char *)(vconv + p * d);
        }
    const int v_f16 = convert ? 0 : f16;
    /* Values: out[t, g] = sum_p e[t, g, p] v[p], up to four heads at a time with the
     * 16-float chunk of each head's output in registers over all keys of the part. */
    for (int64_t t = 0; t < ql; t++)
        for (int64_t g0 = 0; g0 < ng; g0 += 4) {
            const int64_t n4 = ng - g0 < 4 ? ng - g0 : 4;
            const float *e[4];
            for (int64_t g = 0; g < n4; g++) e[g] = SC(t, g0 + g);
            int64_t c = 0;
#if ATTN_VALUE_CHUNK == 32
            for (; c + 32 <= d; c += 32) {
                __m256 acc[16];
                for (int i = 0; i < 16; i++) acc[i] = _mm256_setzero_ps();
                for (int64_t p = kv0 - k0; p < nk; p++) {
                    __m256 v[4];
                    for (int i = 0; i < 4; i++) v[i] = load_kv8(vrows[p], c + 8 * i, v_f16);
                    for (int64_t g = 0; g < n4; g++) {
                        const __m256 w = _mm256_broadcast_ss(e[g] + p);
                        for (int i = 0; i < 4; i++)
                            acc[4 * g + i] = _mm256_fmadd_ps(w, v[i], acc[4 * g + i]);
                    }
                }
                for (int64_t g = 0; g < n4; g++)
                    for (int i = 0; i < 4; i++)
                        _mm256_storeu_ps(RES(t, g0 + g) + c + 8 * i, acc[4 * g + i]);
            }
#endif
            for (; c + 16 <= d; c += 16) {
                __m256 acc[8];
                for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
                for (int64_t p = kv0 - k0; p < nk; p++) {
                    const __m256 v0 = load_kv8(vrows[p], c, v_f16);
                    const __m256 v1 = load_kv8(vrows[p], c + 8, v_f16);
                    for (int64_t g = 0; g < n4; g++) {
                        const __m256 w = _mm256_broadcast_ss(e[g] + p);
                        acc[2 * g] = _mm256_fmadd_ps(w, v0, acc[2 * g]);
                        acc[2 * g + 1] = _mm256_fmadd_ps(w, v1, acc[2 * g + 1]);
                    }
                }
                for (int64_t g = 0; g < n4; g++) {
                    float *o = RES(t, g0 + g) + c;
                    _mm256_storeu_ps(o, acc[2 * g]);
                    _mm256_storeu_ps(o + 8, acc[2 * g + 1]);
                }
            }
            for (; c < d; c++)
                for (int64_t g = 0; g < n4; g++) {
                    float sum = 0.0f;
                    for (int64_t p = kv0 - k0; p < nk; p++)
                        sum = fmaf(e[g][p], load_kv1(vrows[p], c, v_f16), sum);
                    RES(t, g0 + g)[c] = sum;
                }
        }
#undef SC
#undef RES
}

/* attend_part for one query token (a decode row) and the kv heads [kva, kvb) at once, reading
 * the cache position by position: a position's rows of those heads are adjacent in the cache
 * ([.., block_size, kv_heads, head_dim]), so the part streams as contiguous runs instead of
 * one 2-4 KB-strided row per (head, key), which left attend_part waiting on memory for most of
 * a decode step at 512 tokens (5 GB/s of K/V on a 2-core EPYC). Every number is computed as
 * attend_part computes it (the same dot, the same scaling and max, the same exp pass, each
 * output element the same fma chain over the keys in order), so a token's result has the same
 * bits whichever function computed it. Needs (kvb - kva) * group <= ATTN_ROWS_MAX_HEADS. */
#define ATTN_ROWS_MAX_HEADS (ATTN_UNIT * ATTN_MAX_GROUP)
static inline __attribute__((always_inline)) void attend_rows(
    const float *qt, int64_t pos, int64_t len, const void *k_cache, const void *v_cache,
    const int64_t *table, int64_t hkv, int64_t kva, int64_t kvb, int64_t group, int64_t d,
    int64_t bs, int64_t window, float scale, float softcap, int64_t part, int64_t parts,
    float *merge_row, float *local, int f16) {
    const int64_t row_bytes = d * (f16 ? 2 : 4), slot_floats = d + 2;
    const int64_t ha = kva * group, nh = (kvb - kva) * group;
    const int64_t lo = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
    const int64_t k0 = lo / ATTN_PART * ATTN_PART + part * ATTN_PART;
    const int64_t k_end = pos + 1 < len ? pos + 1 : len;
    const int64_t k1 = k0 + ATTN_PART < k_end ? k0 + ATTN_PART : k_end;
    const int64_t kv0 = k0 > lo ? k0 : lo, nk = k1 - k0;
#define RES1(j) (merge_row + ((ha + (j)) * parts + part) * slot_floats)
    for (int64_t j = 0; j < nh; j++) {
        RES1(j)[d] = -INFINITY;
        RES1(j)[d + 1] = 0.0f;
    }
    if (nk <= 0 || kv0 >= k1) return;
    float *scores = local; /* [nh][ATTN_PART] */
#define SC1(j) (scores + (j) * ATTN_PART)
    for (int64_t j = 0; j < nh; j++)
        for (int64_t p = k0; p < kv0; p++) SC1(j)[p - k0] = -INFINITY;
    /* per key: the byte offset of head kva's row, the same in the K and the V cache */
    int64_t at[ATTN_PART];
    for (int64_t p = kv0; p < k1; p++)
        at[p - k0] = ((table[p / bs] * bs + p % bs) * hkv + kva) * row_bytes;
    const char *const kc = (const char *)k_cache, *const vc = (const char *)v_cache;
    const int64_t run_bytes = (kvb - kva) * row_bytes;
    /* Scores: every key of the part is visible to the one query (kv0 is past the window's
     * start, k1 past no position beyond it). */
    for (int64_t p = kv0; p < k1; p++) {
        if (p + 4 < k1) prefetch_bytes(kc + at[p + 4 - k0], run_bytes);
        float dots[ATTN_MAX_GROUP];
        for (int64_t kvh = 0; kvh < kvb - kva; kvh++)
            for (int64_t g0 = 0; g0 < group; g0 += ATTN_MAX_GROUP) {
                const int64_t ng = group - g0 < ATTN_MAX_GROUP ? group - g0 : ATTN_MAX_GROUP;
                dots_shared_key(qt + (ha + kvh * group + g0) * d, ng,
                                kc + at[p - k0] + kvh * row_bytes, d, f16, dots);
                for (int64_t g = 0; g < ng; g++) {
                    const int64_t j = kvh * group + g0 + g;
                    float sc = dots[g] * scale;
                    if (softcap > 0.0f) sc = softcap * tanhf(sc / softcap);
                    SC1(j)[p - k0] = sc;
                    if (sc > RES1(j)[d]) RES1(j)[d] = sc;
                }
            }
    }
    for (int64_t j = 0; j < nh; j++) {
        memset(RES1(j), 0, (size_t)d * sizeof(float)); /* the value pass accumulates here */
        RES1(j)[d + 1] = softmax_numerators(SC1(j), nk, RES1(j)[d]);
    }
    /* Values: each output element one fma chain over the keys in order, from zero. */
    for (int64_t p = kv0; p < k1; p++) {
        const char *vrow = vc + at[p - k0];
        if (p + 4 < k1) prefetch_bytes(vc + at[p + 4 - k0], run_bytes);
        for (int64_t kvh = 0; kvh < kvb - kva; kvh++) {
            const void *v = vrow + kvh * row_bytes;
            for (int64_t g = 0; g < group; g++) {
                const int64_t j = kvh * group + g;
                const __m256 w = _mm256_broadcast_ss(SC1(j) + (p - k0));
                float *o = RES1(j);
                int64_t c = 0;
                for (; c + 8 <= d; c += 8)
                    _mm256_storeu_ps(o + c, _mm256_fmadd_ps(w, load_kv8(v, c, f16),
                                                            _mm256_loadu_ps(o + c)));
                for (; c < d; c++) o[c] = fmaf(SC1(j)[p - k0], load_kv1(v, c, f16), o[c]);
            }
        }
    }
#undef SC1
#undef RES1
}

/* Causal attention of a step's new tokens over their sequences' paged caches (no gathered
 * copy of the context), for any number of tokens: decode rows and prefill chunks alike.
 * Sequence i owns query tokens [q_start[i], q_start[i + 1]) of q, the last chunk of its
 * seq_lens[i] positions; their K/V are already in the cache.
 *   q          [tokens, h, d]
 *   k_cache    [blocks, bs, hkv, d] float32, or float16 when f16; v_cache likewise
 *   block_tables [s, max_blocks] int64, seq_lens [s] int64, q_start [s + 1] int64
 *   window     > 0: a query at position t sees keys in (t - window, t]; 0: all keys <= t
 *   softcap    > 0: scores -> softcap * tanh(scores / softcap); 0: off
 *   plan       attn_plan(q_start, s, h, d, max_len), max_len >= every seq_len
 *   out        [tokens, h, d]
 * Query head j reads kv head j / (h / hkv). Per window of units: phase 1 attends every (unit,
 * kv head, head slice, part) (each key and value vector read once per item), phase 2 merges
 * each (token, head)'s parts in order. */
static inline __attribute__((always_inline)) void attention_body_t(
    const float *q, const int64_t *q_start, const void *k_cache, const void *v_cache,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens, int64_t h,
    int64_t hkv, int64_t d, int64_t bs, int64_t window, float scale, float softcap,
    const AttnPlan *plan, float *out, int f16) {
    const int64_t group = h / hkv, parts = plan->parts, slot_floats = d + 2;
    const int64_t gslices = (group + ATTN_MAX_GROUP - 1) / ATTN_MAX_GROUP;
    float *local = plan->local + omp_get_thread_num() * plan->local_floats;
    for (int64_t w = 0; w < plan->windows; w++) {
        const int64_t u0 = plan->window_unit[w], u1 = plan->window_unit[w + 1];
        const int64_t tok0 = plan->window_tok[w], tok1 = plan->window_tok[w + 1];
        const int64_t us = plan->window_single[w];
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t task = 0; task < (us - u0) * hkv * gslices * parts; task++) {
            const int64_t part = task % parts;
            const int64_t slice = (task / parts) % gslices;
            const int64_t kvh = (task / parts / gslices) % hkv;
            const int64_t u = u0 + task / parts / gslices / hkv;
            const int64_t seq = plan->unit_seq[u], ta = plan->unit_t0[u], tb = plan->unit_t1[u];
            const int64_t h0 = kvh * group + slice * ATTN_MAX_GROUP;
            const int64_t ng = group - slice * ATTN_MAX_GROUP < ATTN_MAX_GROUP
                                   ? group - slice * ATTN_MAX_GROUP : ATTN_MAX_GROUP;
            const int64_t len = seq_lens[seq];
            const int64_t pos_a = len - (q_start[seq + 1] - q_start[seq]) + (ta - q_start[seq]);
            attend_part(q, ta, tb, pos_a, len, k_cache, v_cache,
                        block_tables + seq * max_blocks, h, hkv, kvh, h0, ng, d, bs, window,
                        scale, softcap, part, parts,
                        plan->merge + (ta - tok0) * h * parts * slot_floats, local, f16);
        }
        /* Decode rows: (row, slice of kv heads, part), the slices as wide as the threads
         * leave them (a position's rows of a slice are one contiguous run). */
        const int64_t threads = omp_get_num_threads();
        int64_t per_slice = hkv * parts >= 2 * threads
                                ? hkv / ((2 * threads + parts - 1) / parts) : 1;
        per_slice = per_slice < 1 ? 1 : per_slice;
        while (per_slice > 1 && per_slice * group > ATTN_ROWS_MAX_HEADS) per_slice--;
        const int64_t rslices = (hkv + per_slice - 1) / per_slice;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < (u1 - us) * rslices * parts; task++) {
            const int64_t part = task % parts;
            const int64_t rs = (task / parts) % rslices;
            const int64_t u = us + task / parts / rslices;
            const int64_t seq = plan->unit_seq[u], ta = plan->unit_t0[u];
            const int64_t len = seq_lens[seq];
            const int64_t pos = len - (q_start[seq + 1] - q_start[seq]) + (ta - q_start[seq]);
            float *merge_row = plan->merge + (ta - tok0) * h * parts * slot_floats;
            const int64_t kva = rs * per_slice;
            const int64_t kvb = kva + per_slice < hkv ? kva + per_slice : hkv;
            /* Head by head where rows gain nothing (one kv head: its keys are adjacent
             * anyway, and attend_part keeps its sums in registers) or cannot run (a group too
             * wide for one pass). */
            if (hkv == 1 || group > ATTN_ROWS_MAX_HEADS) {
                for (int64_t kvh = kva; kvh < kvb; kvh++)
                    for (int64_t slice = 0; slice < gslices; slice++) {
                        const int64_t h0 = kvh * group + slice * ATTN_MAX_GROUP;
                        const int64_t ng = group - slice * ATTN_MAX_GROUP < ATTN_MAX_GROUP
                                               ? group - slice * ATTN_MAX_GROUP : ATTN_MAX_GROUP;
                        attend_part(q, ta, ta + 1, pos, len, k_cache, v_cache,
                                    block_tables + seq * max_blocks, h, hkv, kvh, h0, ng, d, bs,
                                    window, scale, softcap, part, parts, merge_row, local, f16);
                    }
                continue;
            }
            attend_rows(q + ta * h * d, pos, len, k_cache, v_cache,
                        block_tables + seq * max_blocks, hkv, kva, kvb, group, d, bs, window,
                        scale, softcap, part, parts, merge_row, local, f16);
        }
        /* Phase 2: merge the parts of every (query token, head), in part order. */
#pragma omp for schedule(static)
        for (int64_t th = 0; th < (tok1 - tok0) * h; th++) {
            const float *base = plan->merge + th * parts * slot_floats;
            float gmax = -INFINITY;
            for (int64_t part = 0; part < parts; part++)
                if (base[part * slot_floats + d] > gmax) gmax = base[part * slot_floats + d];
            float total = 0.0f;
            float *o = out + (tok0 * h + th) * d;
            memset(o, 0, (size_t)d * sizeof(float));
            for (int64_t part = 0; part < parts; part++) {
                const float *sl = base + part * slot_floats;
                if (sl[d + 1] == 0.0f) continue;
                const float wgt = expf(sl[d] - gmax);
                total = fmaf(wgt, sl[d + 1], total);
                axpy_f32(wgt, sl, o, d);
            }
            const float inv = 1.0f / total;
            for (int64_t j = 0; j < d; j++) o[j] *= inv;
        }
    }
}

/* attention_body_t compiled once per cache element type. */
static void attention_body(
    const float *q, const int64_t *q_start, const void *k_cache, const void *v_cache,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens, int64_t h,
    int64_t hkv, int64_t d, int64_t bs, int64_t window, float scale, float softcap,
    const AttnPlan *plan, float *out, int f16) {
    if (f16)
        attention_body_t(q, q_start, k_cache, v_cache, block_tables, max_blocks, seq_lens, h,
                         hkv, d, bs, window, scale, softcap, plan, out, 1);
    else
        attention_body_t(q, q_start, k_cache, v_cache, block_tables, max_blocks, seq_lens, h,
                         hkv, d, bs, window, scale, softcap, plan, out, 0);
}

/* kv_f16: the caches hold float16 (else float32); max_len >= every seq_len. */
LOOM_EXPORT void loom_paged_attention(
    const float *q, const int64_t *q_start, const void *k_cache, const void *v_cache,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens, int64_t s,
    int64_t h, int64_t hkv, int64_t d, int64_t bs, int64_t window, float scale, float softcap,
    int64_t max_len, float *out, int64_t kv_f16) {
    const AttnPlan plan = attn_plan(q_start, s, h, d, max_len);
#pragma omp parallel
    attention_body(q, q_start, k_cache, v_cache, block_tables, max_blocks, seq_lens, h, hkv, d,
                   bs, window, scale, softcap, &plan, out, kv_f16 != 0);
    free_attn_plan(plan);
}

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
 * blocks keep a large k's panel in L1. */
static void w8a8_body(const int8_t *xq, const float *xs, const int32_t *xsum, int64_t m,
                      int64_t k, const uint8_t *wp, const float *scale, const float *bias,
                      int64_t n, float *y) {
    const int64_t groups = (n + COLS - 1) / COLS, panels = (groups + 1) / 2, nb = k / QBLOCK;
    int64_t rows = ROW_BLOCK_BYTES / k / W8A8_ROWS * W8A8_ROWS;
    rows = rows < W8A8_ROWS ? W8A8_ROWS : rows > ROW_BLOCK ? ROW_BLOCK : rows;
    const int64_t blocks = (m + rows - 1) / rows;
    float acc[ROW_BLOCK * 16] __attribute__((aligned(32)));
    /* One pass where a whole panel (16 x k bytes) fits in half of L1. */
    const int64_t pass = nb <= 2 * W8A8_K_BLOCKS ? nb : W8A8_K_BLOCKS;
#pragma omp for schedule(static)
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

/* ---- one decoder layer for a step's tokens (decodes and prefill chunks), in one call ---- */

/* A linear layer as the fused decoder sees it. */
typedef struct {
    /* 0 float32 weight, 1 int8 weight-only (row-major), 2 int8 weights x int8 activations
     * (the weight packed as w8a8_body reads it), 3 w4a8 (weight: a W4Segments) */
    int32_t kind;
    int32_t reserved;
    int64_t in_features, out_features;
    const void *weight; /* float32 or int8 [out_features, in_features], or packed (kind 2) */
    const float *scale; /* [out_features] for the int8 kinds */
    const float *bias;  /* [out_features] or NULL */
} LoomLinear;

/* A pre-norm decoder layer (Llama, Qwen2/3) or, with sandwich_norms, Gemma's layer with norms
 * after attention and after the MLP as well. Norms compute x / rms(x) * (w + norm_offset). */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps, norm_offset;
    int32_t activation;     /* 0 silu, 1 gelu with the tanh approximation */
    int32_t sandwich_norms; /* 1: x + norm(attn), x + norm(mlp); 0: x + attn, x + mlp */
    float attn_scale, softcap; /* softcap 0 = off */
    int64_t window;            /* 0 = full attention */
    LoomLinear qkv, o, gate_up, down;
    const float *input_norm, *post_attn_norm, *pre_ffn_norm, *post_ffn_norm;
    const float *q_norm, *k_norm; /* NULL: no QK norm */
} LoomDecoderLayer;

static void w4_linear_kind3_body(const void *segments, const float *x, int64_t m, int64_t k,
                                 const float *bias, float *y, const QuantBuffers *q);

/* q: the workspace for quantised activations, sized for m rows of the widest input. */
static void linear_any_body(const LoomLinear *l, const float *x, int64_t m, float *y,
                            const QuantBuffers *q) {
    if (l->kind == 0) {
        f32_body(x, m, l->in_features, (const float *)l->weight, l->bias, l->out_features, y);
    } else if (l->kind == 1) {
        w8_body(x, m, l->in_features, (const int8_t *)l->weight, l->scale, l->bias,
                l->out_features, y);
    } else if (l->kind == 2) {
        quantize_rows_body(x, m, l->in_features, q->xq, q->xs, q->xsum);
        w8a8_body(q->xq, q->xs, q->xsum, m, l->in_features, (const uint8_t *)l->weight, l->scale,
                  l->bias, l->out_features, y);
    } else {
        w4_linear_kind3_body(l->weight, x, m, l->in_features, l->bias, y, q);
    }
}

static inline float gelu_tanh(float v) {
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
    return 0.5f * v * (1.0f + tanhf(c * (v + 0.044715f * v * v * v)));
}

/* act(g) * u for 8 lanes: act 1 = tanh-GELU (tanh(y) = 1 - 2 / (exp(2y) + 1)), else SiLU. */
static inline __m256 gated_act256(__m256 g, __m256 u, int activation) {
    const __m256 one = _mm256_set1_ps(1.0f);
    if (activation == 1) {
        const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
        __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                 _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
        y = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-9.0f)), _mm256_set1_ps(9.0f));
        const __m256 e = exp256(_mm256_add_ps(y, y));
        const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f),
                                                          _mm256_add_ps(e, one)));
        return _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g),
                                           _mm256_add_ps(one, t)), u);
    }
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
}

/* Buffers one layer needs, shared by the threads of the step's parallel region. */
typedef struct {
    float *h, *qkv, *q, *k, *q_rot, *k_rot, *attn, *gu, *act;
    QuantBuffers quant;
} Workspace;

/* x += norm(h) with Gemma's sandwich norms (`norm` the post-attention or post-feedforward
 * weight), else x += h: a block's output joins the residual stream. */
static void add_block_output(const LoomDecoderLayer *L, const float *norm, const float *h,
                             float *x, int64_t m) {
    if (L->sandwich_norms) {
        rms_norm_body(h, m, L->hidden, norm, L->norm_offset, L->eps, x, x);
    } else {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < m * L->hidden; t++) x[t] += h[t];
    }
}

/* One layer, called by every thread of the enclosing parallel region. */
static void decode_layer_body(const LoomDecoderLayer *L, float *x, int64_t m, const float *cos_t,
                              const float *sin_t, void *k_cache, void *v_cache, int f16,
                              const int64_t *slots, const int64_t *q_start,
                              const int64_t *block_tables, int64_t max_blocks,
                              const int64_t *seq_lens, int64_t block_size, const AttnPlan *plan,
                              const Workspace *ws) {
    const int64_t hid = L->hidden, d = L->head_dim, inter = L->intermediate;
    const int64_t qd = L->heads * d, kd = L->kv_heads * d, qkv_n = qd + 2 * kd;

    /* Attention block. */
    rms_norm_body(x, m, hid, L->input_norm, L->norm_offset, L->eps, NULL, ws->h);
    linear_any_body(&L->qkv, ws->h, m, ws->qkv, &ws->quant);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++) {
        memcpy(ws->q + r * qd, ws->qkv + r * qkv_n, (size_t)qd * sizeof(float));
        memcpy(ws->k + r * kd, ws->qkv + r * qkv_n + qd, (size_t)kd * sizeof(float));
    }
    if (L->q_norm)
        rms_norm_body(ws->q, m * L->heads, d, L->q_norm, L->norm_offset, L->eps, NULL, ws->q);
    if (L->k_norm)
        rms_norm_body(ws->k, m * L->kv_heads, d, L->k_norm, L->norm_offset, L->eps, NULL, ws->k);
    rope_body(ws->q, m, L->heads, d, cos_t, sin_t, ws->q_rot);
    rope_body(ws->k, m, L->kv_heads, d, cos_t, sin_t, ws->k_rot);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++) {
        const int64_t at = slots[r] * kd * (f16 ? 2 : 4);
        store_kv_row((char *)k_cache + at, ws->k_rot + r * kd, kd, f16);
        store_kv_row((char *)v_cache + at, ws->qkv + r * qkv_n + qd + kd, kd, f16);
    }
    attention_body(ws->q_rot, q_start, k_cache, v_cache, block_tables, max_blocks, seq_lens,
                   L->heads, L->kv_heads, d, block_size, L->window, L->attn_scale, L->softcap,
                   plan, ws->attn, f16);
    linear_any_body(&L->o, ws->attn, m, ws->h, &ws->quant);
    add_block_output(L, L->post_attn_norm, ws->h, x, m);

    /* Feed-forward block. */
    rms_norm_body(x, m, hid, L->pre_ffn_norm, L->norm_offset, L->eps, NULL, ws->h);
    linear_any_body(&L->gate_up, ws->h, m, ws->gu, &ws->quant);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++) {
        const float *g = ws->gu + r * 2 * inter, *u = g + inter;
        float *a = ws->act + r * inter;
        int64_t j = 0;
        for (; j + 8 <= inter; j += 8)
            _mm256_storeu_ps(a + j, gated_act256(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j),
                                                 L->activation));
        for (; j < inter; j++)
            a[j] = (L->activation == 1 ? gelu_tanh(g[j]) : g[j] / (1.0f + expf(-g[j]))) * u[j];
    }
    linear_any_body(&L->down, ws->act, m, ws->h, &ws->quant);
    add_block_output(L, L->post_ffn_norm, ws->h, x, m);
}

/* All decoder layers of a step: x [m, hidden] (updated in place) holds the step's m new
 * tokens, sequence i owning tokens [q_start[i], q_start[i + 1]), the last positions of its
 * seq_lens[i]. Token t goes to cache slot slots[t]; layer l rotates with cos_t[l]/sin_t[l]
 * [m, head_dim] and keeps its cache in k_caches[l]/v_caches[l] [blocks, block_size, kv_heads,
 * head_dim] (float32, or float16 when kv_f16). K/V of the new tokens are written first;
 * attention then reads each context from the paged cache (block_tables [num_seqs,
 * max_blocks]); max_len >= every seq_len. Each layer runs the kernels above in the order the
 * modules call them. */
LOOM_EXPORT void loom_decode_layers(const LoomDecoderLayer *layers, int64_t num_layers, float *x,
                                    int64_t m, const float *const *cos_t,
                                    const float *const *sin_t, void *const *k_caches,
                                    void *const *v_caches, const int64_t *slots,
                                    const int64_t *q_start, int64_t num_seqs,
                                    const int64_t *block_tables, int64_t max_blocks,
                                    const int64_t *seq_lens, int64_t block_size,
                                    int64_t max_len, int64_t kv_f16) {
    int64_t qkv_n = 0, qd = 0, kd = 0, hid = 0, inter = 0, max_k = 0, heads = 0;
    for (int64_t l = 0; l < num_layers; l++) {
        const LoomDecoderLayer *L = &layers[l];
        const int64_t lq = L->heads * L->head_dim, lk = L->kv_heads * L->head_dim;
        qd = lq > qd ? lq : qd;
        kd = lk > kd ? lk : kd;
        qkv_n = lq + 2 * lk > qkv_n ? lq + 2 * lk : qkv_n;
        hid = L->hidden > hid ? L->hidden : hid;
        inter = L->intermediate > inter ? L->intermediate : inter;
        heads = L->heads > heads ? L->heads : heads;
    }
    max_k = hid > qd ? hid : qd;
    max_k = inter > max_k ? inter : max_k;
    Workspace ws;
    ws.h = (float *)malloc((size_t)(m * hid) * sizeof(float));
    ws.qkv = (float *)malloc((size_t)(m * qkv_n) * sizeof(float));
    ws.q = (float *)malloc((size_t)(m * qd) * sizeof(float));
    ws.k = (float *)malloc((size_t)(m * kd) * sizeof(float));
    ws.q_rot = (float *)malloc((size_t)(m * qd) * sizeof(float));
    ws.k_rot = (float *)malloc((size_t)(m * kd) * sizeof(float));
    ws.attn = (float *)malloc((size_t)(m * qd) * sizeof(float));
    int64_t head_dim = 0;
    for (int64_t l = 0; l < num_layers; l++)
        head_dim = layers[l].head_dim > head_dim ? layers[l].head_dim : head_dim;
    const AttnPlan plan = attn_plan(q_start, num_seqs, heads, head_dim, max_len);
    ws.gu = (float *)malloc((size_t)(m * 2 * inter) * sizeof(float));
    ws.act = (float *)malloc((size_t)(m * inter) * sizeof(float));
    ws.quant = quant_buffers(m, max_k);
#pragma omp parallel
    for (int64_t l = 0; l < num_layers; l++) {
        decode_layer_body(&layers[l], x, m, cos_t[l], sin_t[l], k_caches[l], v_caches[l],
                          kv_f16 != 0, slots,
                          q_start, block_tables, max_blocks, seq_lens, block_size, &plan,
                          &ws);
    }
    free(ws.h), free(ws.qkv), free(ws.q), free(ws.k), free(ws.q_rot), free(ws.k_rot);
    free(ws.attn), free(ws.gu), free(ws.act);
    free_attn_plan(plan);
    free_quant_buffers(ws.quant);
}

/* ---- structured output: a grammar's token bitmask applied to logits rows ---- */

/* For each of the n rows `rows[i]` of logits x [*, v]: x[rows[i], j] = -inf where bit j of
 * bits[i] is clear (bit j % 32 of 32-bit word j / 32, as grammar libraries write masks).
 * Words with every bit set are skipped and words with none set are filled, so the cost is
 * one pass over the words plus the forbidden range. */
LOOM_EXPORT void loom_apply_token_bitmask(float *x, int64_t v, const int64_t *rows, int64_t n,
                                          const int32_t *bits, int64_t words) {
    for (int64_t i = 0; i < n; i++) {
        float *xr = x + rows[i] * v;
        const uint32_t *w = (const uint32_t *)(bits + i * words);
        for (int64_t k = 0; k < words; k++) {
            const uint32_t m = w[k];
            if (m == 0xFFFFFFFFu) continue;
            const int64_t base = k * 32;
            const int64_t count = base + 32 <= v ? 32 : v - base;
            for (int64_t b = 0; b < count; b++)
                if (!((m >> b) & 1u)) xr[base + b] = -INFINITY;
        }
    }
}

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

/* ---- GGUF block dequantisation --------------------------------------------------------
 * loom_dequantize(type, src, nblocks, dst): `nblocks` consecutive blocks of a GGML block
 * type (its type id: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14) ->
 * float32 values, in the file's element order, with the float32 operations of the `gguf`
 * package's dequantisers (and so llama.cpp's) in their order, so the result is theirs bit
 * for bit. (Every product of a float16 scale and a block's small integers is exact in
 * float32; only the final addition of a minimum rounds.) The layouts are what the tests
 * check against `gguf`. Returns 0, or -1 for a type this file does not decode. */

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Q4_K and Q5_K: 8 six-bit scales and mins packed in 12 bytes. */
static inline void k_scale_min(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 0x3F;
        mn[j] = s[4 + j] & 0x3F;
        sc[4 + j] = (uint8_t)((s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30));
        mn[4 + j] = (uint8_t)((s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30));
    }
}

static void dequant_q4_0(const uint8_t *b, float *y) { /* 18 bytes -> 32 */
    float d = f16_to_f32(b);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((int)(b[2 + j] & 0x0F) - 8);
        y[16 + j] = d * (float)((int)(b[2 + j] >> 4) - 8);
    }
}

static void dequant_q4_1(const uint8_t *b, float *y) { /* 20 bytes -> 32 */
    float d = f16_to_f32(b), m = f16_to_f32(b + 2);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(b[4 + j] & 0x0F) + m;
        y[16 + j] = d * (float)(b[4 + j] >> 4) + m;
    }
}

static void dequant_q5_0(const uint8_t *b, float *y) { /* 22 bytes -> 32 */
    float d = f16_to_f32(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4); /* bit j: the fifth bit of value j */
    for (int j = 0; j < 16; j++) {
        int lo = (b[6 + j] & 0x0F) | (int)(((qh >> j) & 1) << 4);
        int hi = (b[6 + j] >> 4) | (int)(((qh >> (16 + j)) & 1) << 4);
        y[j] = d * (float)(lo - 16);
        y[16 + j] = d * (float)(hi - 16);
    }
}

static void dequant_q5_1(const uint8_t *b, float *y) { /* 24 bytes -> 32 */
    float d = f16_to_f32(b), m = f16_to_f32(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    for (int j = 0; j < 16; j++) {
        int lo = (b[8 + j] & 0x0F) | (int)(((qh >> j) & 1) << 4);
        int hi = (b[8 + j] >> 4) | (int)(((qh >> (16 + j)) & 1) << 4);
        y[j] = d * (float)lo + m;
        y[16 + j] = d * (float)hi + m;
    }
}

static void dequant_q8_0(const uint8_t *b, float *y) { /* 34 bytes -> 32 */
    float d = f16_to_f32(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)q[j] * d;
}

/* Q4_K's four-bit value of element o of a block: sub-block g = o / 32 is nibble g % 2 of
 * bytes 32 * (g / 2) .. of qs. */
static inline int q4_k_value(const uint8_t *b, int o) {
    return (b[16 + 32 * (o / 64) + o % 32] >> (4 * ((o / 32) % 2))) & 0x0F;
}

static void dequant_q4_k(const uint8_t *b, float *y) { /* 144 bytes -> 256 */
    float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    uint8_t sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
    for (int g = 0; g < 8; g++) {
        float dg = d * (float)sc[g], mg = dmin * (float)mn[g];
        for (int i = 0; i < 32; i++) y[32 * g + i] = dg * (float)q4_k_value(b, 32 * g + i) - mg;
    }
}

static void dequant_q5_k(const uint8_t *b, float *y) { /* 176 bytes -> 256 */
    float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    uint8_t sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int g = 0; g < 8; g++) { /* the fifth bit of sub-block g is bit g of qh[i] */
        float dg = d * (float)sc[g], mg = dmin * (float)mn[g];
        const uint8_t *q = qs + 32 * (g / 2);
        int shift = 4 * (g % 2);
        for (int i = 0; i < 32; i++) {
            int v = ((q[i] >> shift) & 0x0F) | (((qh[i] >> g) & 1) << 4);
            y[32 * g + i] = dg * (float)v - mg;
        }
    }
}

/* Q6_K's six-bit value (0..63) of element o of a block: four low bits from ql, two high
 * bits from qh. */
static inline int q6_k_value(const uint8_t *b, int o) {
    const uint8_t *ql = b, *qh = b + 128;
    int half = o / 128, r = o % 128;
    int low = (ql[64 * half + r % 64] >> (4 * (r / 64))) & 0x0F;
    int high = (qh[32 * half + r % 32] >> (2 * (r / 32))) & 0x03;
    return low | (high << 4);
}

static void dequant_q6_k(const uint8_t *b, float *y) { /* 210 bytes -> 256 */
    const int8_t *scales = (const int8_t *)(b + 192);
    float d = f16_to_f32(b + 208);
    for (int o = 0; o < 256; o++) {
        float ds = d * (float)scales[o / 16];
        y[o] = ds * (float)(q6_k_value(b, o) - 32);
    }
}

LOOM_EXPORT int64_t loom_dequantize(int64_t type, const uint8_t *src, int64_t nblocks,
                                    float *dst) {
    void (*fn)(const uint8_t *, float *);
    int64_t bytes, values;
    switch (type) {
        case 2: fn = dequant_q4_0, bytes = 18, values = 32; break;
        case 3: fn = dequant_q4_1, bytes = 20, values = 32; break;
        case 6: fn = dequant_q5_0, bytes = 22, values = 32; break;
        case 7: fn = dequant_q5_1, bytes = 24, values = 32; break;
        case 8: fn = dequant_q8_0, bytes = 34, values = 32; break;
        case 12: fn = dequant_q4_k, bytes = 144, values = 256; break;
        case 13: fn = dequant_q5_k, bytes = 176, values = 256; break;
        case 14: fn = dequant_q6_k, bytes = 210, values = 256; break;
        default: return -1;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < nblocks; i++) fn(src + i * bytes, dst + i * values);
    return 0;
}


/* ---- w4a8: GGUF K-quant weights computed from their own blocks, int8 activations ----
 *
 * The weights of a Q4_K or Q6_K tensor are the file's integers and scales, repacked once
 * (`loom_w4a8_pack`) so that a 32-byte load holds 4 consecutive k of 8 output columns, as
 * the w8a8 kernel reads its weights; activations are rounded to int8 per block of 32 as w8a8
 * rounds them (quantize_row_q8). For output column c and activation row r, over the blocks b
 * of 32 k in order (super-block s = b / 8, sub-block j = b % 8; xs, X = the block's scale and
 * the plain sum of its int8 values; X_lo, X_hi the sums of its two halves of 16):
 *
 *   Q4_K (w = d * sc * q - dmin * m, q in 0..15):
 *     I    = sum q * xq over the block (exact int32)
 *     acc  = fmaf((float)I, (d[s] * (float)sc[s][j]) * xs, acc)
 *     mins = fmaf(dmin[s] * (float)m[s][j], xs * (float)X, mins)
 *     y    = acc - mins (+ bias)
 *   Q5_K (w = d * sc * q - dmin * m, q in 0..31): as Q4_K
 *   Q6_K (w = d * sc16 * (q - 32), q in 0..63, one scale per 16 k):
 *     J    = sc[s][2j] * (I_lo - 32 * X_lo) + sc[s][2j + 1] * (I_hi - 32 * X_hi)   (int32)
 *     acc  = fmaf((float)J, d[s] * xs, acc)
 *     y    = acc (+ bias)
 *
 * Every integer is exact (|J| < 2^24, so its float is too) and every float operation runs
 * in this order in every variant and in `loom_linear_w4a8_ref` (plain C, one output at a
 * time: the tests' oracle): a row's result is the same bits in any call, batch or chunk.
 *
 * Packed layout, per group of 8 columns (the last padded with zero weights) and super-block
 * of 256 k, records one after another along k:
 *   Q4_K (1216 bytes): d[8] f32 | dmin[8] f32 | sc[8 blocks][8 cols] u8 | m[8][8] u8 |
 *                      lo[8 blocks][128]
 *   Q5_K (2240 bytes): as Q4_K's header | q[8 blocks][256]
 *   Q6_K (2208 bytes): d[8] f32 | sc[16 halves][8 cols] i8 | q[8 blocks][256]
 * lo: byte v * 32 + c * 4 + i holds k = 8 v + i (low nibble) and 8 v + 4 + i (high nibble)
 * of the block; Q5_K's and Q6_K's q one byte each, byte t * 32 + c * 4 + i for k = 4 t + i: a
 * 6-bit value costs as many operations to unpack as to multiply, and on two cores the
 * unpacking made Q6_K layers compute-bound at half the memory's bandwidth (measured: an
 * output projection 5.7 ms packed in 6 bits against 3.7 ms for w8a8's bytes). */

#define W4_SB 256
#define W4_Q4_0 2
#define W4_Q4_1 3
#define W4_Q5_0 6
#define W4_Q5_1 7
#define W4_Q8_0 8
#define W4_Q4K 12
#define W4_Q5K 13
#define W4_Q6K 14
#define W4_REC_Q4K 1216
#define W4_REC_Q5K 2240
#define W4_REC_Q6K 2208

/* The blocks of 32 (see "w4a8 over blocks of 32" below). */
static inline int w4_is_b32(int64_t type) {
    return type == W4_Q4_0 || type == W4_Q4_1 || type == W4_Q5_0 || type == W4_Q5_1 ||
           type == W4_Q8_0;
}
/* Q4_1, Q5_1: w = d * q + m. */
static inline int w4_b32_has_m(int64_t type) { return type == W4_Q4_1 || type == W4_Q5_1; }
/* Q4_0, Q4_1: values packed two to a byte (the others one byte each). */
static inline int w4_b32_nibbles(int64_t type) { return type == W4_Q4_0 || type == W4_Q4_1; }
/* What the stored value holds above the signed one: w = d * (q - offset). */
static inline int w4_b32_offset(int64_t type) {
    return type == W4_Q4_0 ? 8 : type == W4_Q5_0 ? 16 : type == W4_Q8_0 ? 128 : 0;
}
/* Where a b32 record's values start (after d[8], and m[8] where the type has one). */
static inline int64_t w4_b32_q_at(int64_t type) { return w4_b32_has_m(type) ? 64 : 32; }

static inline int64_t w4_record_bytes(int64_t type) {
    if (w4_is_b32(type))
        return w4_b32_q_at(type) + (w4_b32_nibbles(type) ? 128 : 256);
    return type == W4_Q4K ? W4_REC_Q4K : type == W4_Q5K ? W4_REC_Q5K
         : type == W4_Q6K ? W4_REC_Q6K : -1;
}

/* k a record covers: a super-block of 256, or one block of 32. */
static inline int64_t w4_record_k(int64_t type) { return w4_is_b32(type) ? QBLOCK : W4_SB; }

/* Types of the form w = d * sc * q - dmin * m (Q4_K, Q5_K): the same record header and the
 * same float arithmetic; their q differ in width and packing. */
static inline int w4_has_mins(int64_t type) { return type == W4_Q4K || type == W4_Q5K; }

/* The q values (0..15 or 0..63) and scales of one file super-block of one row. */
static void w4_decode_q4k(const uint8_t *b, float *d, float *dmin, uint8_t sc[8],
                          uint8_t mn[8], uint8_t q[256]) {
    *d = f16_to_f32(b), *dmin = f16_to_f32(b + 2);
    k_scale_min(b + 4, sc, mn);
    for (int o = 0; o < 256; o++) q[o] = (uint8_t)q4_k_value(b, o);
}

/* Q5_K's five-bit value of element o of a block: the four low bits as Q4_K's, the fifth is
 * bit o / 32 of qh[o % 32]. */
static inline int q5_k_value(const uint8_t *b, int o) {
    const uint8_t *qh = b + 16, *qs = b + 48;
    const int g = o / 32, i = o % 32;
    return ((qs[32 * (g / 2) + i] >> (4 * (g % 2))) & 0x0F) | (((qh[i] >> g) & 1) << 4);
}

static void w4_decode_q5k(const uint8_t *b, float *d, float *dmin, uint8_t sc[8],
                          uint8_t mn[8], uint8_t q[256]) {
    *d = f16_to_f32(b), *dmin = f16_to_f32(b + 2);
    k_scale_min(b + 4, sc, mn);
    for (int o = 0; o < 256; o++) q[o] = (uint8_t)q5_k_value(b, o);
}

static void w4_decode_q6k(const uint8_t *b, float *d, int8_t sc[16], uint8_t q[256]) {
    for (int o = 0; o < 256; o++) q[o] = (uint8_t)q6_k_value(b, o);
    memcpy(sc, b + 192, 16);
    *d = f16_to_f32(b + 208);
}

/* One file block of 32 of a b32 type: its scale d, its m (Q4_1, Q5_1; else 0) and its 32
 * values as stored in a record (Q8_0's int8 value + 128, the others as the file has them). */
static void w4_decode_b32(int64_t type, const uint8_t *b, float *d, float *m, uint8_t q[32]) {
    *d = f16_to_f32(b);
    *m = w4_b32_has_m(type) ? f16_to_f32(b + 2) : 0.0f;
    if (type == W4_Q8_0) {
        for (int j = 0; j < 32; j++) q[j] = (uint8_t)((int)(int8_t)b[2 + j] + 128);
        return;
    }
    const int has_m = w4_b32_has_m(type), five = !w4_b32_nibbles(type);
    const uint8_t *qs = b + 2 + 2 * has_m + 4 * five;
    uint32_t qh = 0;
    if (five) memcpy(&qh, b + 2 + 2 * has_m, 4); /* bit j: the fifth bit of value j */
    for (int j = 0; j < 16; j++) {
        q[j] = (uint8_t)((qs[j] & 0x0F) | (((qh >> j) & 1) << 4));
        q[16 + j] = (uint8_t)((qs[j] >> 4) | (((qh >> (16 + j)) & 1) << 4));
    }
}

/* Q4_K: the byte of k-in-block kk, column c in a block's lo area, and its nibble's shift. */
static inline int w4_lo_at(int c, int kk) { return (kk / 8) * 32 + c * 4 + kk % 4; }
static inline int w4_lo_shift(int kk) { return 4 * ((kk / 4) % 2); }
/* Q6_K's byte of k-in-super-block kk, column c. */
static inline int w4_byte_at(int c, int kk) { return (kk / 4) * 32 + c * 4 + kk % 4; }

/* raw: the file's blocks of a [n, k] tensor (rows of k / 256 super-blocks, or k / 32 blocks);
 * out: the packed layout above, or the blocks of 32's below (zeroed by the caller). Returns
 * 0, or -1 for another type or a k that is not a multiple of the type's block. */
LOOM_EXPORT int64_t loom_w4a8_pack(int64_t type, const uint8_t *raw, int64_t n, int64_t k,
                                   uint8_t *out) {
    const int64_t rec = w4_record_bytes(type), rk = w4_record_k(type);
    if (rec < 0 || k % rk) return -1;
    const int64_t nsb = k / rk;
    const int64_t src_bytes = type == W4_Q4K ? 144 : type == W4_Q5K ? 176 : type == W4_Q6K ? 210
                            : type == W4_Q4_0 ? 18 : type == W4_Q4_1 ? 20
                            : type == W4_Q5_0 ? 22 : type == W4_Q5_1 ? 24 : 34;
    const int64_t groups = (n + COLS - 1) / COLS;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t s = 0; s < nsb; s++) {
            uint8_t *r = out + (g * nsb + s) * rec;
            for (int c = 0; c < COLS && g * COLS + c < n; c++) {
                const uint8_t *b = raw + ((g * COLS + c) * nsb + s) * src_bytes;
                uint8_t q[256];
                float d;
                if (w4_is_b32(type)) {
                    float m;
                    w4_decode_b32(type, b, &d, &m, q);
                    if (w4_b32_has_m(type)) memcpy(r + 32 + 4 * c, &m, 4);
                    const int64_t at = w4_b32_q_at(type);
                    for (int kk = 0; kk < 32; kk++) {
                        if (w4_b32_nibbles(type))
                            r[at + w4_lo_at(c, kk)] |= (uint8_t)(q[kk] << w4_lo_shift(kk));
                        else
                            r[at + w4_byte_at(c, kk)] = q[kk];
                    }
                } else if (w4_has_mins(type)) {
                    uint8_t sc[8], mn[8];
                    float dmin;
                    if (type == W4_Q4K)
                        w4_decode_q4k(b, &d, &dmin, sc, mn, q);
                    else
                        w4_decode_q5k(b, &d, &dmin, sc, mn, q);
                    memcpy(r + 32 + 4 * c, &dmin, 4);
                    for (int j = 0; j < 8; j++) r[64 + j * 8 + c] = sc[j], r[128 + j * 8 + c] = mn[j];
                    for (int kk = 0; kk < 256; kk++) {
                        if (type == W4_Q4K)
                            r[192 + (kk / 32) * 128 + w4_lo_at(c, kk % 32)] |=
                                (uint8_t)(q[kk] << w4_lo_shift(kk % 32));
                        else
                            r[192 + w4_byte_at(c, kk)] = q[kk];
                    }
                } else {
                    int8_t sc[16];
                    w4_decode_q6k(b, &d, sc, q);
                    for (int h = 0; h < 16; h++) r[32 + h * 8 + c] = (uint8_t)sc[h];
                    for (int kk = 0; kk < 256; kk++) r[160 + w4_byte_at(c, kk)] = q[kk];
                }
                memcpy(r + 4 * c, &d, 4);
            }
        }
    return 0;
}

/* Weight of column c (0..7), k-in-super-block kk, of one record, with the file's float
 * operations (dequant_q4_k / dequant_q6_k): the same bits as dequantising the file. */
static inline float w4_weight(int64_t type, const uint8_t *r, int c, int kk) {
    const int j = kk / 32, i = kk % 32;
    float d;
    memcpy(&d, r + 4 * c, 4);
    if (w4_is_b32(type)) { /* kk < 32: one block a record */
        const int64_t at = w4_b32_q_at(type);
        const int q = w4_b32_nibbles(type) ? (r[at + w4_lo_at(c, kk)] >> w4_lo_shift(kk)) & 15
                                           : r[at + w4_byte_at(c, kk)];
        if (!w4_b32_has_m(type)) return d * (float)(q - w4_b32_offset(type));
        float m;
        memcpy(&m, r + 32 + 4 * c, 4);
        return d * (float)q + m;
    }
    if (w4_has_mins(type)) {
        float dmin;
        memcpy(&dmin, r + 32 + 4 * c, 4);
        const int q = type == W4_Q4K ? (r[192 + j * 128 + w4_lo_at(c, i)] >> w4_lo_shift(i)) & 15
                                     : r[192 + w4_byte_at(c, kk)];
        return d * (float)r[64 + j * 8 + c] * (float)q - dmin * (float)r[128 + j * 8 + c];
    }
    const float ds = d * (float)(int8_t)r[32 + (2 * j + i / 16) * 8 + c];
    return ds * (float)(r[160 + w4_byte_at(c, kk)] - 32);
}

/* The float32 weight [n, k] of a packed tensor (tests, and hosts without the kernels'
 * w4a8 path). Returns 0 or -1 for an unknown type. */
LOOM_EXPORT int64_t loom_w4a8_dequantize(int64_t type, const uint8_t *packed, int64_t n,
                                         int64_t k, float *out) {
    const int64_t rec = w4_record_bytes(type), rk = w4_record_k(type);
    if (rec < 0 || k % rk) return -1;
    const int64_t nsb = k / rk;
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < n; o++)
        for (int64_t s = 0; s < nsb; s++) {
            const uint8_t *r = packed + ((o / COLS) * nsb + s) * rec;
            for (int kk = 0; kk < rk; kk++)
                out[o * k + s * rk + kk] = w4_weight(type, r, (int)(o % COLS), kk);
        }
    return 0;
}

/* The activations of a w4a8 call are QuantBuffers with xsx and x16 filled. */
typedef QuantBuffers W4Act;

/* The sum of 16 int8 values (explicit 256-bit code: a vectorised loop on the AVX-512 build
 * would use 512-bit instructions, which the kernels avoid). */
static inline int32_t w4_sum16(__m128i v) {
    const __m256i s = _mm256_madd_epi16(_mm256_cvtepi8_epi16(v), _mm256_set1_epi16(1));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    return _mm_cvtsi128_si32(t);
}

static void w4_act_finish_row(W4Act a, int64_t r, int64_t k) {
    const int64_t nb = k / QBLOCK;
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *q = a.xq + r * k + b * QBLOCK;
        const int32_t lo = w4_sum16(_mm_loadu_si128((const __m128i *)q));
        const int32_t hi = w4_sum16(_mm_loadu_si128((const __m128i *)(q + 16)));
        a.x16[(r * nb + b) * 2] = lo, a.x16[(r * nb + b) * 2 + 1] = hi;
        a.xsx[r * nb + b] = a.xs[r * nb + b] * (float)(lo + hi);
    }
}

static void w4_act_body(const float *x, int64_t m, int64_t k, W4Act a) {
    const int64_t nb = k / QBLOCK;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++) {
        quantize_row_q8(x + r * k, k, a.xq + r * k, a.xs + r * nb, a.xsum + r * nb);
        w4_act_finish_row(a, r, k);
    }
}

/* The segments of a w4a8 linear layer (what LoomLinear.weight points to for kind 3). */
#define W4_MAX_SEGMENTS 4
typedef struct {
    int64_t count;
    int64_t types[W4_MAX_SEGMENTS];
    const uint8_t *packed[W4_MAX_SEGMENTS];
    int64_t columns[W4_MAX_SEGMENTS];
} W4Segments;

static void w4_linear_segments_body(const W4Segments *segs, const W4Act *a, int64_t m,
                                    int64_t k, const float *bias, float *y);

static inline __m256i w4_x4(const W4Act *a, int64_t row, int64_t k, int64_t at) {
    int32_t v;
    memcpy(&v, a->xq + row * k + at, 4);
    return _mm256_set1_epi32(v);
}

/* 8 bytes -> 8 floats (u8 or i8). */
static inline __m256 w4_u8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256i w4_i8x8(const uint8_t *p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

#define W4_MAXR 6
/* Rows of a prefill tile of Q4_K / Q5_K with AVX-512VL's registers (Q6_K's two accumulators
 * per output keep 4). */
#ifndef W4_PREFILL_ROWS
#define W4_PREFILL_ROWS 6
#endif
#define W4_MAXC 2
/* With AVX-512VL's 32 vector registers, tiles of 4 rows (6 for Q4_K / Q5_K) x 2 groups keep
 * their accumulators in registers (AVX2's 16 hold 2 x 2). */
#if defined(__AVX512VL__)
#define W4_WIDE 1
#else
#define W4_WIDE 0
#endif
/* Software prefetch distance over a group's records (the DRAM stream of a decode step). */
#define W4_PREFETCH_RECORDS 4

/* iacc[r][c] + the exact products of one block of 32 activations (at: its first k) of rows
 * r0 .. r0 + R with C groups' weights at q[c]: nibbles (Q4_K's lo area, Q4_0, Q4_1), 4 steps
 * of 8 k; or one byte a value (Q5_K, Q5_0, Q5_1; Q8_0's value + 128 with `q8`), 8 steps of
 * 4 k. The integer sums are exact in any order. */
static inline __attribute__((always_inline)) void w4_block_dots(
    __m256i iacc[W4_MAXR][W4_MAXC], const uint8_t *const q[W4_MAXC], int nibbles, int q8,
    const W4Act *a, int64_t r0, int R, int C, int64_t k, int64_t at) {
    if (nibbles) {
        const __m256i low4 = _mm256_set1_epi8(15);
        for (int v = 0; v < 4; v++) {
            __m256i lo[W4_MAXC], hi[W4_MAXC];
            for (int c = 0; c < C; c++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(q[c] + v * 32));
                lo[c] = _mm256_and_si256(raw, low4);
                hi[c] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            }
            for (int r = 0; r < R; r++) {
                const __m256i x0 = w4_x4(a, r0 + r, k, at + 8 * v);
                const __m256i x1 = w4_x4(a, r0 + r, k, at + 8 * v + 4);
                for (int c = 0; c < C; c++)
                    iacc[r][c] = dot_u8s8(dot_u8s8(iacc[r][c], lo[c], x0), hi[c], x1);
            }
        }
        return;
    }
    for (int t = 0; t < 8; t++) {
        __m256i w[W4_MAXC];
        for (int c = 0; c < C; c++) w[c] = _mm256_loadu_si256((const __m256i *)(q[c] + t * 32));
        for (int r = 0; r < R; r++) {
            const __m256i x = w4_x4(a, r0 + r, k, at + 4 * t);
            for (int c = 0; c < C; c++)
                iacc[r][c] = q8 ? dot4x8_i8(iacc[r][c], w[c], x) : dot_u8s8(iacc[r][c], w[c], x);
        }
    }
}

/* y[r0 + r, columns of groups g0 + c] = acc[r][c] (+ bias): a tile's results, the last
 * group's padding columns left out. */
static inline __attribute__((always_inline)) void w4_store_tile(
    __m256 acc[W4_MAXR][W4_MAXC], int R, int C, int64_t r0, int64_t g0, int64_t n,
    const float *bias, float *y, int64_t ny) {
    for (int c = 0; c < C; c++) {
        const int64_t col = (g0 + c) * COLS;
        const int64_t valid = n - col < COLS ? n - col : COLS;
        for (int r = 0; r < R; r++) {
            float v[COLS];
            _mm256_storeu_ps(v, acc[r][c]);
            float *yr = y + (r0 + r) * ny + col;
            for (int64_t i = 0; i < valid; i++) yr[i] = bias ? v[i] + bias[col + i] : v[i];
        }
    }
}

/* y[r0 .. r0 + R, columns of groups g0 .. g0 + C] of one segment, as the arithmetic above
 * says; w: the segment's packed weight, n its columns, y0 the segment's first column in y
 * (row stride ny). */
static inline __attribute__((always_inline)) void w4_tile(
    int64_t type, const W4Act *a, int64_t r0, int R, int64_t k, const uint8_t *w, int64_t g0,
    int C, int64_t n, const float *bias, float *y, int64_t ny, int prefetch) {
    const int64_t nsb = k / W4_SB, nb = k / QBLOCK, rec = w4_record_bytes(type);
    /* Q4_K's and Q5_K's minimum terms: in the main loop where registers allow (decode),
     * else in their own pass over the blocks (below); the same operations in the same
     * order either way */
    const int INLINE_MINS = w4_has_mins(type) && R * C <= 2;
    __m256 acc[W4_MAXR][W4_MAXC], mins[W4_MAXR][W4_MAXC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = mins[r][c] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *rc[W4_MAXC];
        for (int c = 0; c < C; c++) rc[c] = w + ((g0 + c) * nsb + s) * rec;
        /* the groups' records are one stream: a group's first records follow the last of
         * the one before */
        if (prefetch && (g0 + C - 1) * nsb + s + W4_PREFETCH_RECORDS < (n + COLS - 1) / COLS * nsb)
            for (int c = 0; c < C; c++) prefetch_bytes(rc[c] + W4_PREFETCH_RECORDS * rec, rec);
        for (int j = 0; j < 8; j++) {
            const int64_t b = s * 8 + j, at = b * QBLOCK;
            if (w4_has_mins(type)) {
                __m256i iacc[W4_MAXR][W4_MAXC];
                for (int r = 0; r < R; r++)
                    for (int c = 0; c < C; c++) iacc[r][c] = _mm256_setzero_si256();
                const uint8_t *q[W4_MAXC];
                for (int c = 0; c < C; c++)
                    q[c] = rc[c] + 192 + j * (type == W4_Q4K ? 128 : 256);
                w4_block_dots(iacc, q, type == W4_Q4K, 0, a, r0, R, C, k, at);
                for (int c = 0; c < C; c++) {
                    const __m256 ds = _mm256_mul_ps(_mm256_loadu_ps((const float *)rc[c]),
                                                    w4_u8x8(rc[c] + 64 + j * 8));
                    for (int r = 0; r < R; r++) {
                        const int64_t ab = (r0 + r) * nb + b;
                        const __m256 coef = _mm256_mul_ps(ds, _mm256_set1_ps(a->xs[ab]));
                        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r][c]), coef,
                                                    acc[r][c]);
                    }
                    if (INLINE_MINS) {
                        const __m256 dm = _mm256_mul_ps(_mm256_loadu_ps((const float *)(rc[c] + 32)),
                                                        w4_u8x8(rc[c] + 128 + j * 8));
                        for (int r = 0; r < R; r++)
                            mins[r][c] = _mm256_fmadd_ps(
                                dm, _mm256_set1_ps(a->xsx[(r0 + r) * nb + b]), mins[r][c]);
                    }
                }
            } else {
                /* J = sum over the halves of sc_h * sum q * xq, minus 32 * (sc_a X_a +
                 * sc_b X_b): the scales enter as the int16 multipliers of the pair sums
                 * (maddubs pairs, then madd by the column's scale: exact), the correction
                 * as one madd of the (sc_a, sc_b) pair by (X_a, X_b). */
                __m256i iacc[W4_MAXR][W4_MAXC];
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
                /* VNNI: each half's plain sums (one instruction a step), then the scales. */
                __m256i ihi[W4_MAXR][W4_MAXC], sc32[W4_MAXC][2];
                for (int c = 0; c < C; c++) {
                    sc32[c][0] = w4_i8x8(rc[c] + 32 + 16 * j);
                    sc32[c][1] = w4_i8x8(rc[c] + 40 + 16 * j);
                }
#else
                /* AVX2: the scales are the int16 multipliers of the pair sums; pair16 holds
                 * each column's (sc_a, sc_b) for the correction. */
                __m256i scale16[W4_MAXC][2], pair16[W4_MAXC];
                for (int c = 0; c < C; c++) {
                    const __m128i sa = _mm_loadl_epi64((const __m128i *)(rc[c] + 32 + 16 * j));
                    const __m128i sb = _mm_loadl_epi64((const __m128i *)(rc[c] + 40 + 16 * j));
                    scale16[c][0] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sa, sa));
                    scale16[c][1] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sb, sb));
                    pair16[c] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sa, sb));
                }
#endif
                for (int r = 0; r < R; r++) {
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
                    /* each half's sum starts from -32 X (the q - 32 offset), so the scale
                     * multiplies (I - 32 X) directly */
                    const int64_t ab = (r0 + r) * nb + b;
                    const __m256i lo0 = _mm256_set1_epi32(-32 * a->x16[2 * ab]);
                    const __m256i hi0 = _mm256_set1_epi32(-32 * a->x16[2 * ab + 1]);
                    for (int c = 0; c < C; c++) iacc[r][c] = lo0, ihi[r][c] = hi0;
#else
                    for (int c = 0; c < C; c++) iacc[r][c] = _mm256_setzero_si256();
#endif
                }
                for (int t = 0; t < 8; t++) { /* steps of 4 k; 0-3 the first half */
                    __m256i q[W4_MAXC];
                    for (int c = 0; c < C; c++)
                        q[c] = _mm256_loadu_si256(
                            (const __m256i *)(rc[c] + 160 + j * 256 + t * 32));
                    for (int r = 0; r < R; r++) {
                        const __m256i x = w4_x4(a, r0 + r, k, at + 4 * t);
                        for (int c = 0; c < C; c++) {
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
                            if (t < 4) iacc[r][c] = dot_u8s8(iacc[r][c], q[c], x);
                            else ihi[r][c] = dot_u8s8(ihi[r][c], q[c], x);
#else
                            iacc[r][c] = _mm256_add_epi32(iacc[r][c], _mm256_madd_epi16(
                                _mm256_maddubs_epi16(q[c], x), scale16[c][t / 4]));
#endif
                        }
                    }
                }
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
                for (int r = 0; r < R; r++)
                    for (int c = 0; c < C; c++)
                        iacc[r][c] = _mm256_add_epi32(_mm256_mullo_epi32(sc32[c][0], iacc[r][c]),
                                                      _mm256_mullo_epi32(sc32[c][1], ihi[r][c]));
#endif
                for (int c = 0; c < C; c++) {
                    const __m256 d = _mm256_loadu_ps((const float *)rc[c]);
                    for (int r = 0; r < R; r++) {
                        const int64_t ab = (r0 + r) * nb + b;
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
                        const __m256i jj = iacc[r][c]; /* the offset is in already */
#else
                        const uint32_t xab = (uint32_t)(uint16_t)a->x16[2 * ab] |
                                             (uint32_t)a->x16[2 * ab + 1] << 16;
                        const __m256i corr = _mm256_slli_epi32(
                            _mm256_madd_epi16(pair16[c], _mm256_set1_epi32((int32_t)xab)), 5);
                        const __m256i jj = _mm256_sub_epi32(iacc[r][c], corr);
#endif
                        const __m256 coef = _mm256_mul_ps(d, _mm256_set1_ps(a->xs[ab]));
                        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(jj), coef, acc[r][c]);
                    }
                }
            }
        }
    }
    /* The minimum terms of larger tiles, in their own pass over the blocks (in order):
     * out of the main loop's registers, which the products' accumulators need. */
    for (int c = 0; w4_has_mins(type) && !INLINE_MINS && c < C; c++) {
        for (int64_t s = 0; s < nsb; s++) {
            const uint8_t *rcs = w + ((g0 + c) * nsb + s) * rec;
            const __m256 dmin = _mm256_loadu_ps((const float *)(rcs + 32));
            for (int j = 0; j < 8; j++) {
                const __m256 dm = _mm256_mul_ps(dmin, w4_u8x8(rcs + 128 + j * 8));
                for (int r = 0; r < R; r++)
                    mins[r][c] = _mm256_fmadd_ps(
                        dm, _mm256_set1_ps(a->xsx[(r0 + r) * nb + s * 8 + j]), mins[r][c]);
            }
        }
    }
    for (int r = 0; w4_has_mins(type) && r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_sub_ps(acc[r][c], mins[r][c]);
    w4_store_tile(acc, R, C, r0, g0, n, bias, y, ny);
}

/* ---- w4a8 over blocks of 32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 ----
 *
 * Files store a matrix in these where its rows are not whole super-blocks of 256 (the K-quant
 * fallbacks of Q4_K_M files: Gemma 3 270M's 640-wide q/k/v and gate/up are Q5_0), or all of
 * it (Q4_0, Q8_0 files). One record per group of 8 columns and block of 32 k:
 *   d[8] f32 | m[8] f32 (Q4_1, Q5_1 only) | q
 * q as Q4_K's lo area of one block for Q4_0 and Q4_1 (128 bytes), else one byte per value
 * (256 bytes, byte t * 32 + c * 4 + i for k = 4 t + i; Q8_0's int8 value + 128). With I the
 * block's sum of stored q * xq (exact) and X the plain sum of its int8 activations:
 *
 *   J    = I - offset * X     (offset 8 for Q4_0, 16 for Q5_0, 128 for Q8_0, else 0; exact)
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
        w4_block_dots(iacc, q, nibbles, type == W4_Q8_0, a, r0, R, C, k, at);
        for (int c = 0; c < C; c++) {
            const __m256 d = _mm256_loadu_ps((const float *)rc[c]);
            for (int r = 0; r < R; r++) {
                const __m256 coef = _mm256_mul_ps(d, _mm256_set1_ps(a->xs[(r0 + r) * nb + b]));
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r][c]), coef, acc[r][c]);
            }
            if (INLINE_MINS) {
                const __m256 m = _mm256_loadu_ps((const float *)(rc[c] + 32));
                for (int r = 0; r < R; r++)
                    mins[r][c] = _mm256_fmadd_ps(
                        m, _mm256_set1_ps(a->xsx[(r0 + r) * nb + b]), mins[r][c]);
            }
        }
    }
    /* The m terms of larger tiles, in their own pass over the blocks (in order). */
    for (int c = 0; has_m && !INLINE_MINS && c < C; c++)
        for (int64_t b = 0; b < nb; b++) {
            const __m256 m = _mm256_loadu_ps((const float *)(w + ((g0 + c) * nb + b) * rec + 32));
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
                    const int q = w4_b32_nibbles(type)
                                      ? (rc[qat + w4_lo_at(c, i)] >> w4_lo_shift(i)) & 15
                                      : rc[qat + w4_byte_at(c, i)];
                    i32 += q * xq[i];
                    x_sum += xq[i];
                }
                float d, mm;
                memcpy(&d, rc + 4 * c, 4);
                acc = fmaf((float)(i32 - w4_b32_offset(type) * x_sum), d * a->xs[ab], acc);
                if (w4_b32_has_m(type)) {
                    memcpy(&mm, rc + 32 + 4 * c, 4);
                    mins = fmaf(mm, a->xsx[ab], mins);
                }
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
                    float d;
                    memcpy(&d, rc + 4 * c, 4);
                    if (w4_has_mins(type)) {
                        int32_t i32 = 0;
                        for (int i = 0; i < 32; i++)
                            i32 += (type == W4_Q4K
                                    ? (rc[192 + j * 128 + w4_lo_at(c, i)] >> w4_lo_shift(i)) & 15
                                    : rc[192 + w4_byte_at(c, (int)(32 * j) + i)]) * xq[i];
                        float dmin;
                        memcpy(&dmin, rc + 32 + 4 * c, 4);
                        const float ds = d * (float)rc[64 + j * 8 + c];
                        acc = fmaf((float)i32, ds * a.xs[ab], acc);
                        mins = fmaf(dmin * (float)rc[128 + j * 8 + c], a.xsx[ab], mins);
                    } else {
                        int32_t half[2] = {0, 0};
                        for (int i = 0; i < 32; i++)
                            half[i / 16] += rc[160 + w4_byte_at(c, (int)(32 * j) + i)] * xq[i];
                        const int32_t sa = (int8_t)rc[32 + (2 * j) * 8 + c];
                        const int32_t sb = (int8_t)rc[32 + (2 * j + 1) * 8 + c];
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
