/* GGUF block dequantisation.
 * A part of cpu_kernels.c's one translation unit: it may use what common.h and the parts
 * included before it define. */

/* ---- GGUF block dequantisation --------------------------------------------------------
 * loom_dequantize(type, src, nblocks, dst): `nblocks` consecutive blocks of a GGML block
 * type (its type id: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14,
 * MXFP4 39) ->
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

/* MXFP4's E8M0 block scale e as float32, halved (the E2M1 values are stored doubled):
 * 2^(e - 128), exact (a subnormal for e < 2), as ggml's e8m0_to_fp32_half. */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? (uint32_t)0x00200000u << e : (uint32_t)(e - 1) << 23;
    float d;
    memcpy(&d, &bits, 4);
    return d;
}

/* MXFP4's E2M1 codes (a nibble) as doubled values: w = e8m0_half(e) * value. */
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static void dequant_mxfp4(const uint8_t *b, float *y) { /* 17 bytes -> 32 */
    const float d = e8m0_half(b[0]);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)MXFP4_VALUES[b[1 + j] & 0x0F];
        y[16 + j] = d * (float)MXFP4_VALUES[b[1 + j] >> 4];
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
        case 39: fn = dequant_mxfp4, bytes = 17, values = 32; break;
        default: return -1;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < nblocks; i++) fn(src + i * bytes, dst + i * values);
    return 0;
}
