/* w4a8 from GGUF K-quant blocks (Q4_K, Q5_K, Q6_K).
 * A part of cpu_kernels.c's one translation unit: it may use what common.h and the parts
 * included before it define. */

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
 *   Q4_K (1184 bytes): d[8] f16 | dmin[8] f16 | sc[8 blocks][8 cols] u8 | m[8][8] u8 |
 *                      lo[8 blocks][128]
 *   Q5_K (2208 bytes): as Q4_K's header | q[8 blocks][256]
 *   Q6_K (1680 bytes): d[8] f16 | sc[16 halves][8 cols] i8 | 8 blocks of (lo[128] | hi[64])
 * The scales are the file's float16 bits (w4_scales8 widens them, exactly, where they are
 * used): a record is no wider than the file's blocks need (Q6_K 210 bytes a column and
 * super-block, as the file; Q4_K 148 against 144, its six-bit sc and m a byte each).
 * lo: byte v * 32 + c * 4 + i holds k = 8 v + i (low nibble) and 8 v + 4 + i (high nibble)
 * of the block (Q6_K's four low bits); Q5_K's q one byte each, byte t * 32 + c * 4 + i for
 * k = 4 t + i; hi (Q6_K's top two bits): byte u * 32 + c * 4 + i holds k = 16 u + 4 p + i in
 * bits 2p, 2p + 1.
 *
 * Q6_K holds the file's 6.56 bits a value. Its layers are most of a Q4_K_M
 * model's bytes a token (the experts' down projections, attn_v, the output head), and with
 * VNNI's one-instruction sums the unpacking (an and, a shift and an or per 32 values) keeps
 * a decode step memory-bound; each block's lo and hi are adjacent, so a record is read as
 * one stream (lo and hi as separate areas left the prefetchers two streams a record and
 * read 30% slower than a byte a value). Measured on 2 Zen 4 cores (benchmarks/ab_kernels.py
 * w4a8 --type 14 --k 2048): 1.35-1.53x a byte a value's speed at 1 row, 1.42x at 2, equal at
 * 8, 0.9x at 64 (prefill is compute-bound; the unpacking costs there). */

#define W4_SB 256
#define W4_Q4_0 2
#define W4_Q4_1 3
#define W4_Q5_0 6
#define W4_Q5_1 7
#define W4_Q8_0 8
#define W4_MXFP4 39
#define W4_Q4K 12
#define W4_Q5K 13
#define W4_Q6K 14
#define W4_REC_Q4K 1184
#define W4_REC_Q5K 2208
#define W4_REC_Q6K 1680
/* Where a K-quant record's parts start: Q4_K / Q5_K (d at 0), and Q6_K (d at 0). */
#define W4_KM_DMIN 16
#define W4_KM_SC 32
#define W4_KM_M 96
#define W4_KM_Q 160
#define W4_Q6_SC 16
#define W4_Q6_BLOCKS 144

/* The blocks of 32 (see "w4a8 over blocks of 32" below). */
static inline int w4_is_b32(int64_t type) {
    return type == W4_Q4_0 || type == W4_Q4_1 || type == W4_Q5_0 || type == W4_Q5_1 ||
           type == W4_Q8_0 || type == W4_MXFP4;
}
/* Q4_1, Q5_1: w = d * q + m. */
static inline int w4_b32_has_m(int64_t type) { return type == W4_Q4_1 || type == W4_Q5_1; }
/* Q4_0, Q4_1, MXFP4: values packed two to a byte (the others one byte each). */
static inline int w4_b32_nibbles(int64_t type) {
    return type == W4_Q4_0 || type == W4_Q4_1 || type == W4_MXFP4;
}
/* MXFP4 stores E2M1 codes: a nibble q stands for MXFP4_LUT[q] = the doubled value + 12 (0 ..
 * 24, unsigned for the u8 x s8 products), so w = d * (MXFP4_LUT[q] - 12) with d the halved
 * E8M0 scale: every product an exact integer, as the other types'. */
static inline int w4_b32_lut(int64_t type) { return type == W4_MXFP4; }
static const uint8_t MXFP4_LUT[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
/* What the stored value holds above the signed one: w = d * (q - offset). */
static inline int w4_b32_offset(int64_t type) {
    return type == W4_Q4_0 ? 8 : type == W4_Q5_0 ? 16 : type == W4_Q8_0 ? 128
         : type == W4_MXFP4 ? 12 : 0;
}
/* A b32 record's stored value q of a nibble or byte (MXFP4's code through its table). */
static inline int w4_b32_value(int64_t type, int q) { return w4_b32_lut(type) ? MXFP4_LUT[q] : q; }
/* Where a b32 record's values start (after d[8], and m[8] where the type has one: 16 bits
 * each). */
static inline int64_t w4_b32_q_at(int64_t type) { return w4_b32_has_m(type) ? 32 : 16; }

/* A record's scales (d, dmin, m) are 16 bits a column: the file's float16 as it is, or for
 * MXFP4 the halved E8M0 scale (a power of two, 2^-128 .. 2^127: outside float16's range) as
 * bfloat16, which holds every power of two in float32's range exactly. Widening either to
 * float32 is exact, so the arithmetic below sees the same floats as the file's. */
static inline int w4_scale_bf16(int64_t type) { return type == W4_MXFP4; }

/* Column c's scale of the 8 at p, as float32. */
static inline float w4_scale(int64_t type, const uint8_t *p, int c) {
    if (!w4_scale_bf16(type)) return f16_to_f32(p + 2 * c);
    uint16_t h;
    memcpy(&h, p + 2 * c, 2);
    const uint32_t bits = (uint32_t)h << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

/* The 8 columns' scales at p, as float32 lanes. */
static inline __m256 w4_scales8(int64_t type, const uint8_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (!w4_scale_bf16(type)) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Column c's scale at p: the file's float16 bits at `half`, as they are. */
static inline void w4_copy_scale(uint8_t *p, int c, const uint8_t *half) {
    memcpy(p + 2 * c, half, 2);
}

/* Column c's scale at p from MXFP4's E8M0 byte e: the halved scale as bfloat16, the top half
 * of its float32 (whose low 16 bits are 0: a power of two). */
static inline void w4_store_e8m0(uint8_t *p, int c, uint8_t e) {
    const float v = e8m0_half(e);
    uint32_t bits;
    memcpy(&bits, &v, 4);
    const uint16_t h = (uint16_t)(bits >> 16);
    memcpy(p + 2 * c, &h, 2);
}

static inline int64_t w4_record_bytes(int64_t type) {
    if (w4_is_b32(type))
        return w4_b32_q_at(type) + (w4_b32_nibbles(type) ? 128 : 256);
    return type == W4_Q4K ? W4_REC_Q4K : type == W4_Q5K ? W4_REC_Q5K
         : type == W4_Q6K ? W4_REC_Q6K : -1;
}

/* k a record covers: a super-block of 256, or one block of 32. */
static inline int64_t w4_record_k(int64_t type) { return w4_is_b32(type) ? QBLOCK : W4_SB; }

/* A record's bytes (-1 for a type w4a8 does not pack): what cpu_ops.W4A8_TYPES states. */
LOOM_EXPORT int64_t loom_w4a8_record_bytes(int64_t type) { return w4_record_bytes(type); }

/* Types of the form w = d * sc * q - dmin * m (Q4_K, Q5_K): the same record header and the
 * same float arithmetic; their q differ in width and packing. */
static inline int w4_has_mins(int64_t type) { return type == W4_Q4K || type == W4_Q5K; }

/* 32 nibbles (each below 16, one to a byte: nib[0..15] in `first`, nib[16..31] in `second`)
 * of one block of column c written into the block's lo area: lo[v * 32 + c * 4 + i] =
 * nib[8 v + i] | nib[8 v + 4 + i] << 4. Each 16-byte half is shuffled to [v lows | v + 1 lows
 * | v highs | v + 1 highs] (4 bytes each), the halves' lows and highs joined, the highs
 * shifted into the upper nibble (a 16-bit shift: every byte is below 16, so nothing crosses
 * into its neighbour), and lane v stored at lo + 32 v. */
static inline void w4_store_nibbles(__m128i first, __m128i second, uint8_t *lo, int c) {
    const __m128i order = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
    const __m128i n0 = _mm_shuffle_epi8(first, order), n1 = _mm_shuffle_epi8(second, order);
    const __m128i lows = _mm_unpacklo_epi64(n0, n1), highs = _mm_unpackhi_epi64(n0, n1);
    uint32_t lanes[4];
    _mm_storeu_si128((__m128i *)lanes, _mm_or_si128(lows, _mm_slli_epi16(highs, 4)));
    for (int v = 0; v < 4; v++) memcpy(lo + v * 32 + c * 4, &lanes[v], 4);
}

/* The low (high = 0) or high nibbles of 32 file bytes at src as one block of column c (no
 * per-value decode: the first load packs billions of them). */
static inline void w4_pack_nibbles(const uint8_t *src, int high, uint8_t *lo, int c) {
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i x0 = _mm_loadu_si128((const __m128i *)src);
    const __m128i x1 = _mm_loadu_si128((const __m128i *)(src + 16));
    w4_store_nibbles(_mm_and_si128(high ? _mm_srli_epi16(x0, 4) : x0, nibble),
                     _mm_and_si128(high ? _mm_srli_epi16(x1, 4) : x1, nibble), lo, c);
}

/* The 32 values of one file block of 32 stored as nibbles (Q4_0, Q4_1, MXFP4: byte j holds
 * value j in its low nibble and value 16 + j in its high one), the 16 bytes at src, as one
 * block of column c. */
static inline void w4_pack_nibbles16(const uint8_t *src, uint8_t *lo, int c) {
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i x = _mm_loadu_si128((const __m128i *)src);
    w4_store_nibbles(_mm_and_si128(x, nibble), _mm_and_si128(_mm_srli_epi16(x, 4), nibble),
                     lo, c);
}

/* The 32 five-bit values of one file Q5_0 or Q5_1 block (qh: bit j the fifth bit of value j;
 * byte j of qs: value j in its low nibble, 16 + j in its high one) written into column c of
 * a one-byte-a-value block area (values 4 t .. 4 t + 3 at byte t * 32 + c * 4): each fifth
 * bit is spread to its byte by a shuffle of qh's bytes and a compare with the bit's mask. */
static inline void w4_pack_q5_block(const uint8_t *qs, uint32_t qh, uint8_t *q_area, int c) {
    const __m128i nibble = _mm_set1_epi8(0x0F), fifth = _mm_set1_epi8(0x10);
    const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    const __m128i bits = _mm_cvtsi32_si128((int)qh);
    const __m128i x = _mm_loadu_si128((const __m128i *)qs);
    const __m128i nibbles[2] = {_mm_and_si128(x, nibble),
                                _mm_and_si128(_mm_srli_epi16(x, 4), nibble)};
    for (int half = 0; half < 2; half++) { /* values 16 half .. 16 half + 15 */
        const __m128i spread = _mm_shuffle_epi8(bits, _mm_setr_epi8(
            (char)(2 * half), (char)(2 * half), (char)(2 * half), (char)(2 * half),
            (char)(2 * half), (char)(2 * half), (char)(2 * half), (char)(2 * half),
            (char)(2 * half + 1), (char)(2 * half + 1), (char)(2 * half + 1),
            (char)(2 * half + 1), (char)(2 * half + 1), (char)(2 * half + 1),
            (char)(2 * half + 1), (char)(2 * half + 1)));
        const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit);
        uint32_t words[4];
        _mm_storeu_si128((__m128i *)words,
                         _mm_or_si128(nibbles[half], _mm_and_si128(set, fifth)));
        for (int t = 0; t < 4; t++) memcpy(q_area + (4 * half + t) * 32 + c * 4, &words[t], 4);
    }
}

/* The six-bit scales of one file Q4_K super-block of one row, and its nibbles written into
 * column c's lo areas of record r. Blocks 2p and 2p + 1 are the low and high nibbles of the
 * same 32 file bytes (q4_k_value). */
static void w4_pack_q4k(const uint8_t *b, uint8_t sc[8], uint8_t mn[8], uint8_t *r, int c) {
    k_scale_min(b + 4, sc, mn);
    for (int j = 0; j < 8; j++)
        w4_pack_nibbles(b + 16 + 32 * (j / 2), j % 2, r + W4_KM_Q + j * 128, c);
}

/* One file Q6_K super-block of one row written into column c of record r: its scales, its
 * low nibbles (block j = 4 h + q of the half h: the low (q < 2) or high nibbles of file bytes
 * ql[64 h + 32 (q % 2) ..], q6_k_value) and its top two bits (bits 2q, 2q + 1 of qh[32 h + l]
 * for k = l of the block), in the layout above. */
static void w4_pack_q6k(const uint8_t *b, uint8_t *r, int c) {
    const uint8_t *ql = b, *qh = b + 128;
    for (int j = 0; j < 8; j++) {
        const int h = j / 4, q = j % 4;
        w4_pack_nibbles(ql + 64 * h + 32 * (q % 2), q / 2, r + W4_Q6_BLOCKS + j * 192, c);
        uint8_t *hi = r + W4_Q6_BLOCKS + 128 + j * 192 + c * 4;
        for (int u = 0; u < 2; u++) {
            /* Byte i of word p is qh[32 h + 16 u + 4 p + i] (k = 16 u + 4 p + i); its bits
             * 2q, 2q + 1 go to bits 2p, 2p + 1 of hi[u * 32 + i], four bytes at a time (the
             * mask keeps each byte's own two bits after the shift, as 2q + 1 < 8). */
            uint32_t bits = 0;
            for (int p = 0; p < 4; p++) {
                uint32_t word;
                memcpy(&word, qh + 32 * h + 16 * u + 4 * p, 4);
                bits |= ((word >> (2 * q)) & 0x03030303u) << (2 * p);
            }
            memcpy(hi + u * 32, &bits, 4);
        }
    }
    for (int s = 0; s < 16; s++) r[W4_Q6_SC + s * 8 + c] = b[192 + s];
    w4_copy_scale(r, c, b + 208);
}

/* Q5_K's five-bit value of element o of a block: the four low bits as Q4_K's, the fifth is
 * bit o / 32 of qh[o % 32]. */
static inline int q5_k_value(const uint8_t *b, int o) {
    const uint8_t *qh = b + 16, *qs = b + 48;
    const int g = o / 32, i = o % 32;
    return ((qs[32 * (g / 2) + i] >> (4 * (g % 2))) & 0x0F) | (((qh[i] >> g) & 1) << 4);
}

static void w4_decode_q5k(const uint8_t *b, uint8_t sc[8], uint8_t mn[8], uint8_t q[256]) {
    k_scale_min(b + 4, sc, mn);
    for (int o = 0; o < 256; o++) q[o] = (uint8_t)q5_k_value(b, o);
}

/* Q4_K: the byte of k-in-block kk, column c in a block's lo area, and its nibble's shift. */
static inline int w4_lo_at(int c, int kk) { return (kk / 8) * 32 + c * 4 + kk % 4; }
static inline int w4_lo_shift(int kk) { return 4 * ((kk / 4) % 2); }
/* Q5_K's and the one-byte b32 types' byte of k kk, column c. */
static inline int w4_byte_at(int c, int kk) { return (kk / 4) * 32 + c * 4 + kk % 4; }
/* Q6_K: the byte of k-in-block kk, column c, in a block's hi area, and its two bits' shift. */
static inline int w4_hi_at(int c, int kk) { return (kk / 16) * 32 + c * 4 + kk % 4; }
static inline int w4_hi_shift(int kk) { return 2 * ((kk / 4) % 4); }

/* raw: the file's blocks of a [n, k] tensor (rows of k / 256 super-blocks, or k / 32 blocks);
 * out: the packed layout above, or the blocks of 32's below (every byte written: each record is
 * zeroed, then filled). Returns 0, or -1 for another type or a k that is not a multiple of the
 * type's block. */
LOOM_EXPORT int64_t loom_w4a8_pack(int64_t type, const uint8_t *raw, int64_t n, int64_t k,
                                   uint8_t *out) {
    const int64_t rec = w4_record_bytes(type), rk = w4_record_k(type);
    if (rec < 0 || k % rk) return -1;
    const int64_t nsb = k / rk;
    const int64_t src_bytes = type == W4_Q4K ? 144 : type == W4_Q5K ? 176 : type == W4_Q6K ? 210
                            : type == W4_Q4_0 ? 18 : type == W4_Q4_1 ? 20
                            : type == W4_Q5_0 ? 22 : type == W4_Q5_1 ? 24
                            : type == W4_MXFP4 ? 17 : 34;
    const int64_t groups = (n + COLS - 1) / COLS;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t s = 0; s < nsb; s++) {
            uint8_t *r = out + (g * nsb + s) * rec;
            memset(r, 0, (size_t)rec); /* the columns past n stay 0 (the others are stored) */
            for (int c = 0; c < COLS && g * COLS + c < n; c++) {
                const uint8_t *b = raw + ((g * COLS + c) * nsb + s) * src_bytes;
                if (w4_is_b32(type)) {
                    const int has_m = w4_b32_has_m(type);
                    uint8_t *q_area = r + w4_b32_q_at(type);
                    if (type == W4_MXFP4)
                        w4_store_e8m0(r, c, b[0]);
                    else
                        w4_copy_scale(r, c, b);
                    if (has_m) w4_copy_scale(r + 16, c, b + 2);
                    if (w4_b32_nibbles(type)) { /* the codes as they are */
                        w4_pack_nibbles16(b + (type == W4_MXFP4 ? 1 : 2 + 2 * has_m), q_area, c);
                    } else if (type == W4_Q8_0) { /* int8 + 128: the top bit flipped */
                        for (int t = 0; t < 8; t++) {
                            uint32_t word;
                            memcpy(&word, b + 2 + 4 * t, 4);
                            word ^= 0x80808080u;
                            memcpy(q_area + w4_byte_at(c, 4 * t), &word, 4);
                        }
                    } else { /* Q5_0, Q5_1 */
                        uint32_t qh;
                        memcpy(&qh, b + 2 + 2 * has_m, 4);
                        w4_pack_q5_block(b + 6 + 2 * has_m, qh, q_area, c);
                    }
                } else if (w4_has_mins(type)) {
                    uint8_t sc[8], mn[8];
                    if (type == W4_Q4K) {
                        w4_pack_q4k(b, sc, mn, r, c);
                    } else {
                        uint8_t q[256];
                        w4_decode_q5k(b, sc, mn, q);
                        for (int t = 0; t < 64; t++)
                            memcpy(r + W4_KM_Q + t * 32 + c * 4, q + 4 * t, 4);
                    }
                    w4_copy_scale(r, c, b);
                    w4_copy_scale(r + W4_KM_DMIN, c, b + 2);
                    for (int j = 0; j < 8; j++)
                        r[W4_KM_SC + j * 8 + c] = sc[j], r[W4_KM_M + j * 8 + c] = mn[j];
                } else {
                    w4_pack_q6k(b, r, c);
                }
            }
        }
    return 0;
}

/* Q6_K's six-bit value (0..63) of column c, k-in-super-block kk, of one record. */
static inline int w4_q6k_value(const uint8_t *r, int c, int kk) {
    const int j = kk / 32, i = kk % 32;
    const uint8_t *block = r + W4_Q6_BLOCKS + j * 192;
    const int lo = (block[w4_lo_at(c, i)] >> w4_lo_shift(i)) & 15;
    const int hi = (block[128 + w4_hi_at(c, i)] >> w4_hi_shift(i)) & 3;
    return lo | hi << 4;
}

/* Weight of column c (0..7), k-in-super-block kk, of one record, with the file's float
 * operations (dequant_q4_k / dequant_q6_k): the same bits as dequantising the file. */
static inline float w4_weight(int64_t type, const uint8_t *r, int c, int kk) {
    const int j = kk / 32, i = kk % 32;
    const float d = w4_scale(type, r, c);
    if (w4_is_b32(type)) { /* kk < 32: one block a record */
        const int64_t at = w4_b32_q_at(type);
        const int q = w4_b32_value(
            type, w4_b32_nibbles(type) ? (r[at + w4_lo_at(c, kk)] >> w4_lo_shift(kk)) & 15
                                       : r[at + w4_byte_at(c, kk)]);
        if (!w4_b32_has_m(type)) return d * (float)(q - w4_b32_offset(type));
        return d * (float)q + w4_scale(type, r + 16, c);
    }
    if (w4_has_mins(type)) {
        const float dmin = w4_scale(type, r + W4_KM_DMIN, c);
        const int q = type == W4_Q4K
                          ? (r[W4_KM_Q + j * 128 + w4_lo_at(c, i)] >> w4_lo_shift(i)) & 15
                          : r[W4_KM_Q + w4_byte_at(c, kk)];
        return d * (float)r[W4_KM_SC + j * 8 + c] * (float)q -
               dmin * (float)r[W4_KM_M + j * 8 + c];
    }
    const float ds = d * (float)(int8_t)r[W4_Q6_SC + (2 * j + i / 16) * 8 + c];
    return ds * (float)(w4_q6k_value(r, c, kk) - 32);
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

/* acc + the products of two steps of 4 k (u8 weights w0, w1 by s8 activations x0, x1). */
static inline __m256i w4_dot2(__m256i acc, __m256i w0, __m256i x0, __m256i w1, __m256i x1) {
    return dot_u8s8(dot_u8s8(acc, w0, x0), w1, x1);
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
 * r0 .. r0 + R with C groups' weights at q[c]: nibbles (Q4_K's lo area, Q4_0, Q4_1; MXFP4's
 * codes through its table with `lut`), 4 steps
 * of 8 k; or one byte a value (Q5_K, Q5_0, Q5_1; Q8_0's value + 128 with `q8`), 8 steps of
 * 4 k. The integer sums are exact in any order. */
static inline __attribute__((always_inline)) void w4_block_dots(
    __m256i iacc[W4_MAXR][W4_MAXC], const uint8_t *const q[W4_MAXC], int nibbles, int q8,
    int lut, const W4Act *a, int64_t r0, int R, int C, int64_t k, int64_t at) {
    if (nibbles) {
        const __m256i low4 = _mm256_set1_epi8(15);
        const __m256i table = _mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)MXFP4_LUT));
        for (int v = 0; v < 4; v++) {
            __m256i lo[W4_MAXC], hi[W4_MAXC];
            for (int c = 0; c < C; c++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(q[c] + v * 32));
                lo[c] = _mm256_and_si256(raw, low4);
                hi[c] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                if (lut) { /* MXFP4: codes -> stored values (w4_b32_value) */
                    lo[c] = _mm256_shuffle_epi8(table, lo[c]);
                    hi[c] = _mm256_shuffle_epi8(table, hi[c]);
                }
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
                    q[c] = rc[c] + W4_KM_Q + j * (type == W4_Q4K ? 128 : 256);
                w4_block_dots(iacc, q, type == W4_Q4K, 0, 0, a, r0, R, C, k, at);
                for (int c = 0; c < C; c++) {
                    const __m256 ds = _mm256_mul_ps(w4_scales8(type, rc[c]),
                                                    w4_u8x8(rc[c] + W4_KM_SC + j * 8));
                    for (int r = 0; r < R; r++) {
                        const int64_t ab = (r0 + r) * nb + b;
                        const __m256 coef = _mm256_mul_ps(ds, _mm256_set1_ps(a->xs[ab]));
                        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r][c]), coef,
                                                    acc[r][c]);
                    }
                    if (INLINE_MINS) {
                        const __m256 dm = _mm256_mul_ps(w4_scales8(type, rc[c] + W4_KM_DMIN),
                                                        w4_u8x8(rc[c] + W4_KM_M + j * 8));
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
                    sc32[c][0] = w4_i8x8(rc[c] + W4_Q6_SC + 16 * j);
                    sc32[c][1] = w4_i8x8(rc[c] + W4_Q6_SC + 8 + 16 * j);
                }
#else
                /* AVX2: the scales are the int16 multipliers of the pair sums; pair16 holds
                 * each column's (sc_a, sc_b) for the correction. */
                __m256i scale16[W4_MAXC][2], pair16[W4_MAXC];
                for (int c = 0; c < C; c++) {
                    const __m128i sa = _mm_loadl_epi64(
                        (const __m128i *)(rc[c] + W4_Q6_SC + 16 * j));
                    const __m128i sb = _mm_loadl_epi64(
                        (const __m128i *)(rc[c] + W4_Q6_SC + 8 + 16 * j));
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
                /* Steps of 4 k, two at a time: the lo bytes of k 16 u + 8 v + (0..7) and
                 * their top bits, bits 4 v + (0, 1) and 4 v + (2, 3) of the hi bytes of
                 * half u, moved to bits 4 and 5. Both loops unrolled (64-row calls ran 5%
                 * slower without the pragmas; the same bits). */
                const __m256i low4 = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
#pragma GCC unroll 2
                for (int u = 0; u < 2; u++) {
                    __m256i h[W4_MAXC];
                    for (int c = 0; c < C; c++)
                        h[c] = _mm256_loadu_si256(
                            (const __m256i *)(rc[c] + W4_Q6_BLOCKS + 128 + j * 192 + u * 32));
#pragma GCC unroll 2
                    for (int v = 0; v < 2; v++) {
                        __m256i q0[W4_MAXC], q1[W4_MAXC];
                        for (int c = 0; c < C; c++) {
                            const __m256i raw = _mm256_loadu_si256(
                                (const __m256i *)(rc[c] + W4_Q6_BLOCKS + j * 192 +
                                                  (2 * u + v) * 32));
                            const __m256i h0 = v ? h[c] : _mm256_slli_epi16(h[c], 4);
                            const __m256i h1 = v ? _mm256_srli_epi16(h[c], 2)
                                                 : _mm256_slli_epi16(h[c], 2);
                            q0[c] = _mm256_or_si256(_mm256_and_si256(raw, low4),
                                                    _mm256_and_si256(h0, top));
                            q1[c] = _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4),
                                _mm256_and_si256(h1, top));
                        }
                        for (int r = 0; r < R; r++) {
                            const int64_t kx = at + 16 * u + 8 * v;
                            const __m256i x0 = w4_x4(a, r0 + r, k, kx);
                            const __m256i x1 = w4_x4(a, r0 + r, k, kx + 4);
                            for (int c = 0; c < C; c++) {
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
                                if (u == 0)
                                    iacc[r][c] = w4_dot2(iacc[r][c], q0[c], x0, q1[c], x1);
                                else
                                    ihi[r][c] = w4_dot2(ihi[r][c], q0[c], x0, q1[c], x1);
#else
                                iacc[r][c] = _mm256_add_epi32(iacc[r][c], _mm256_madd_epi16(
                                    _mm256_maddubs_epi16(q0[c], x0), scale16[c][u]));
                                iacc[r][c] = _mm256_add_epi32(iacc[r][c], _mm256_madd_epi16(
                                    _mm256_maddubs_epi16(q1[c], x1), scale16[c][u]));
#endif
                            }
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
                    const __m256 d = w4_scales8(type, rc[c]);
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
            const __m256 dmin = w4_scales8(type, rcs + W4_KM_DMIN);
            for (int j = 0; j < 8; j++) {
                const __m256 dm = _mm256_mul_ps(dmin, w4_u8x8(rcs + W4_KM_M + j * 8));
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
