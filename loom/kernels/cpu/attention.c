/* Paged attention over float32 or float16 K/V caches.
 * A part of cpu_kernels.c's one translation unit: it may use what common.h and the parts
 * included before it define. */

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

/* Eight hsum256 at once: lane i of the result is hsum256(a[i]), bit for bit (the same
 * additions in the same order: a[i][k] + a[i][k + 4], then (k = 0) + (k = 2) and (k = 1) +
 * (k = 3), then those two), done lane-parallel with shuffles instead of eight reductions. */
static inline __m256 hsum256_x8(const __m256 a[8]) {
    __m256 x[4];
    for (int i = 0; i < 4; i++) /* lanes [a_i lo + a_i hi | a_{i+4} lo + a_{i+4} hi] */
        x[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[i], a[i + 4], 0x20),
                             _mm256_permute2f128_ps(a[i], a[i + 4], 0x31));
    /* per 128-bit lane: [x0 s0 + s2, x0 s1 + s3, x1 s0 + s2, x1 s1 + s3] */
    const __m256 y01 = _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 y23 = _mm256_add_ps(_mm256_shuffle_ps(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_shuffle_ps(y01, y23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(y01, y23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Query heads whose dots with one key run in one pass: each head keeps two 8-lane
 * accumulators, so eight heads need 16 registers (CPUs with 32 vector registers). */
#if defined(__AVX512VL__)
#define ATTN_DOT_HEADS 8
#else
#define ATTN_DOT_HEADS 4
#endif

/* out[g] = dot(q + g * d, key) for the ng <= 8 query heads that share one key vector: the
 * key is loaded once per 16 floats for ATTN_DOT_HEADS heads, which accumulate in independent
 * registers (a single dot product is bound by the latency of its own additions). Each dot:
 * two 8-lane accumulators over d in steps of 16 (elements j..j+7 and j+8..j+15), added,
 * hsum256, then the tail elements in order. */
static inline void dots_shared_key(const float *q, int64_t ng, const void *key, int64_t d,
                                   int f16, float *out) {
    for (int64_t g0 = 0; g0 < ng; g0 += ATTN_DOT_HEADS) {
        const int64_t nh = ng - g0 < ATTN_DOT_HEADS ? ng - g0 : ATTN_DOT_HEADS;
        __m256 acc[2 * ATTN_DOT_HEADS];
        for (int i = 0; i < 2 * ATTN_DOT_HEADS; i++) acc[i] = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 16 <= d; j += 16) {
            const __m256 k0 = load_kv8(key, j, f16), k1 = load_kv8(key, j + 8, f16);
            for (int64_t g = 0; g < nh; g++) {
                const float *qg = q + (g0 + g) * d + j;
                acc[2 * g] = _mm256_fmadd_ps(_mm256_loadu_ps(qg), k0, acc[2 * g]);
                acc[2 * g + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8), k1, acc[2 * g + 1]);
            }
        }
        __m256 pair[8];
        for (int g = 0; g < 8; g++)
            pair[g] = g < nh ? _mm256_add_ps(acc[2 * g], acc[2 * g + 1]) : _mm256_setzero_ps();
        float sums[8];
        _mm256_storeu_ps(sums, hsum256_x8(pair));
        for (int64_t g = 0; g < nh; g++) {
            float sum = sums[g];
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
        __m256 pair[8]; /* heads g of key 0 in lanes 0-3, of key 1 in lanes 4-7 */
        for (int g = 0; g < 4; g++) {
            pair[g] = g < n4 ? _mm256_add_ps(a[2 * g], a[2 * g + 1]) : _mm256_setzero_ps();
            pair[4 + g] = g < n4 ? _mm256_add_ps(b[2 * g], b[2 * g + 1]) : _mm256_setzero_ps();
        }
        float sums[8];
        _mm256_storeu_ps(sums, hsum256_x8(pair));
        for (int64_t g = 0; g < n4; g++) {
            float s0 = sums[g], s1 = sums[4 + g];
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

/* o[g][c] = sum over keys p in [p0, p1) of e[g][p] * v_p[c] for n4 <= 4 heads sharing the
 * value rows vrows[p] (float16 when f16): each output element one fma chain over the keys in
 * order, from zero, with the chunk of each head's output (32 or 16 floats) in registers over
 * all the keys. Every attention path computes its values with this one. */
static inline void weighted_values(const char *const *vrows, int64_t p0, int64_t p1,
                                   const float *const *e, float *const *o, int64_t n4,
                                   int64_t d, int f16) {
    int64_t c = 0;
#if ATTN_VALUE_CHUNK == 32
    for (; c + 32 <= d; c += 32) {
        __m256 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t p = p0; p < p1; p++) {
            __m256 v[4];
            for (int i = 0; i < 4; i++) v[i] = load_kv8(vrows[p], c + 8 * i, f16);
            for (int64_t g = 0; g < n4; g++) {
                const __m256 w = _mm256_broadcast_ss(e[g] + p);
                for (int i = 0; i < 4; i++)
                    acc[4 * g + i] = _mm256_fmadd_ps(w, v[i], acc[4 * g + i]);
            }
        }
        for (int64_t g = 0; g < n4; g++)
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(o[g] + c + 8 * i, acc[4 * g + i]);
    }
#endif
    for (; c + 16 <= d; c += 16) {
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t p = p0; p < p1; p++) {
            const __m256 v0 = load_kv8(vrows[p], c, f16);
            const __m256 v1 = load_kv8(vrows[p], c + 8, f16);
            for (int64_t g = 0; g < n4; g++) {
                const __m256 w = _mm256_broadcast_ss(e[g] + p);
                acc[2 * g] = _mm256_fmadd_ps(w, v0, acc[2 * g]);
                acc[2 * g + 1] = _mm256_fmadd_ps(w, v1, acc[2 * g + 1]);
            }
        }
        for (int64_t g = 0; g < n4; g++) {
            _mm256_storeu_ps(o[g] + c, acc[2 * g]);
            _mm256_storeu_ps(o[g] + c + 8, acc[2 * g + 1]);
        }
    }
    for (; c < d; c++)
        for (int64_t g = 0; g < n4; g++) {
            float sum = 0.0f;
            for (int64_t p = p0; p < p1; p++) sum = fmaf(e[g][p], load_kv1(vrows[p], c, f16), sum);
            o[g][c] = sum;
        }
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
    /* Values: out[t, g] = sum_p e[t, g, p] v[p], up to four heads at a time. */
    for (int64_t t = 0; t < ql; t++)
        for (int64_t g0 = 0; g0 < ng; g0 += 4) {
            const int64_t n4 = ng - g0 < 4 ? ng - g0 : 4;
            const float *e[4];
            float *o[4];
            for (int64_t g = 0; g < n4; g++) e[g] = SC(t, g0 + g), o[g] = RES(t, g0 + g);
            weighted_values(vrows, kv0 - k0, nk, e, o, n4, d, v_f16);
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
        if (p + 4 < k1) {
            prefetch_bytes(kc + at[p + 4 - k0], run_bytes);
            prefetch_bytes(vc + at[p + 4 - k0], run_bytes);
        }
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
    for (int64_t j = 0; j < nh; j++)
        RES1(j)[d + 1] = softmax_numerators(SC1(j), nk, RES1(j)[d]);
    /* Values, kv head by kv head (the part's V rows were prefetched with its keys). */
    const char *vrows[ATTN_PART];
    for (int64_t kvh = 0; kvh < kvb - kva; kvh++) {
        for (int64_t p = kv0 - k0; p < nk; p++) vrows[p] = vc + at[p] + kvh * row_bytes;
        for (int64_t g0 = 0; g0 < group; g0 += 4) {
            const int64_t n4 = group - g0 < 4 ? group - g0 : 4;
            const float *e[4];
            float *o[4];
            for (int64_t g = 0; g < n4; g++) {
                const int64_t j = kvh * group + g0 + g;
                e[g] = SC1(j), o[g] = RES1(j);
            }
            weighted_values(vrows, kv0 - k0, nk, e, o, n4, d, f16);
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
 *   sinks      NULL, or [h]: head j's sink logit joins each of its rows' softmax (max and sum)
 *   plan       attn_plan(q_start, s, h, d, max_len), max_len >= every seq_len
 *   out        [tokens, h, d]
 * Query head j reads kv head j / (h / hkv). Per window of units: phase 1 attends every (unit,
 * kv head, head slice, part) (each key and value vector read once per item), phase 2 merges
 * each (token, head)'s parts in order. */
static inline __attribute__((always_inline)) void attention_body_t(
    const float *q, const int64_t *q_start, const void *k_cache, const void *v_cache,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens, int64_t h,
    int64_t hkv, int64_t d, int64_t bs, int64_t window, float scale, float softcap,
    const float *sinks, const AttnPlan *plan, float *out, int f16) {
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
        /* Decode rows: (row, slice of kv heads, part), the slices as wide as four tasks per
         * thread leave them (a position's rows of a slice are one contiguous run; with fewer
         * tasks, a step of one row over a few parts left one thread waiting for the other). */
        const int64_t threads = omp_get_num_threads();
        const int64_t row_parts = (u1 - us) * parts > 0 ? (u1 - us) * parts : 1;
        int64_t per_slice = hkv / ((4 * threads + row_parts - 1) / row_parts);
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
        /* Phase 2: merge the parts of every (query token, head), in part order; a head's
         * sink (a logit without a value) joins the max first and the sum last. */
#pragma omp for schedule(static)
        for (int64_t th = 0; th < (tok1 - tok0) * h; th++) {
            const float *base = plan->merge + th * parts * slot_floats;
            const float sink = sinks ? sinks[th % h] : -INFINITY;
            float gmax = sink;
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
            if (sinks) total += expf(sink - gmax);
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
    const float *sinks, const AttnPlan *plan, float *out, int f16) {
    if (f16)
        attention_body_t(q, q_start, k_cache, v_cache, block_tables, max_blocks, seq_lens, h,
                         hkv, d, bs, window, scale, softcap, sinks, plan, out, 1);
    else
        attention_body_t(q, q_start, k_cache, v_cache, block_tables, max_blocks, seq_lens, h,
                         hkv, d, bs, window, scale, softcap, sinks, plan, out, 0);
}

/* kv_f16: the caches hold float16 (else float32); max_len >= every seq_len; sinks: NULL, or
 * one logit per query head [h] that joins every row's softmax denominator (attention sinks). */
LOOM_EXPORT void loom_paged_attention(
    const float *q, const int64_t *q_start, const void *k_cache, const void *v_cache,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens, int64_t s,
    int64_t h, int64_t hkv, int64_t d, int64_t bs, int64_t window, float scale, float softcap,
    const float *sinks, int64_t max_len, float *out, int64_t kv_f16) {
    const AttnPlan plan = attn_plan(q_start, s, h, d, max_len);
#pragma omp parallel
    attention_body(q, q_start, k_cache, v_cache, block_tables, max_blocks, seq_lens, h, hkv, d,
                   bs, window, scale, softcap, sinks, &plan, out, kv_f16 != 0);
    free_attn_plan(plan);
}
