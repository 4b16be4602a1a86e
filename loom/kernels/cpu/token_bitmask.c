/* Structured output's token bitmask on logits rows.
 * A part of cpu_kernels.c's one translation unit: it may use what common.h and the parts
 * included before it define. */

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
