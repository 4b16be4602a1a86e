/* The mixture-of-experts feed-forward block (loom/models/moe.py's SparseMoE) in C.
 * A part of cpu_kernels.c's one translation unit: it may use what common.h and the parts
 * included before it define (it comes last: it runs the linear kinds of decoder_layer.c and
 * the w4a8 segments of w4a8_blocks32.c; decoder_layer.c forward-declares what it calls).
 *
 * For the rows x [m, hidden] of a step:
 *
 *   logits  = x @ router.T (+ router_bias)      f32_body: a row's logits are the same bits
 *                                               in any call (the module path's Router too)
 *   p       = softmax(logits)                   float32: max, expf(l - max), their sum in
 *                                               index order, p = e / sum
 *   experts = the top_k of p, ties to the lower index
 *   weights = p[experts] (/ their sum, added in slot order, when renormalize)
 *   (gpt-oss, MOE_TOPK_SOFTMAX: experts = the top_k logits, weights = their softmax)
 *   y[t]    = ((y_0 * w_0) + y_1 * w_1) + ...   y_s = expert s's gated MLP of x[t], added in
 *                                               slot order (a multiply, then an add: no FMA)
 *
 * The (token, slot) pairs are grouped by expert (experts ascending, tokens ascending within
 * one), so an expert's weights are read once per call however many tokens chose it. Each
 * expert's linear layers are the fused decoder's kinds, whose product for a row does not
 * depend on the other rows of the call (f32_body and w8_body sum every row in one order;
 * w8a8 and w4a8 sum integers exactly, then floats in a fixed order), and the activation is
 * the dense FFN's (gated_act_row): a token's output is the same bits whatever else is in its
 * step, and equal to the expert modules composed row by row.
 *
 * Barriers: the experts of a stage (gate_up, then down) run their kinds-2/3 worksharing loops
 * without a barrier between experts (each writes its own rows) and wait once at the end; a
 * decode step of top-8 experts is then about ten barriers a layer, not four per expert. A
 * decode step (m = 1) of w4a8 experts that split evenly over the threads runs "whole
 * experts" instead (moe_whole_experts): each thread runs gate_up, the activation and down of
 * its own experts with no barrier between them, and waits once before the sum. */

/* The block as the kernels see it: arrays of num_experts linear layers (the fused
 * decoder's kinds 0-3), gate_up [2 * intermediate, hidden] (gate rows, then up rows) and
 * down [hidden, intermediate]; the router float32 [num_experts, hidden]. */
struct LoomMoE {
    int64_t num_experts, top_k, hidden, intermediate;
    int32_t renormalize, activation; /* activation: a GatedAct code (as the dense FFN) */
    const float *router;
    const LoomLinear *gate_up;
    const LoomLinear *down;
    const float *router_bias; /* [num_experts] or NULL */
    int32_t scoring;          /* MOE_SOFTMAX or MOE_TOPK_SOFTMAX (moe_route_row) */
    float act_alpha, act_limit;
};

/* How router logits become (experts, weights): a softmax over every expert, then the top k
 * of it; or the top k logits, then a softmax over those k (gpt-oss). */
#define MOE_SOFTMAX 0
#define MOE_TOPK_SOFTMAX 1

/* The buffers of one block call, sized once per call (a step) for m tokens of the largest
 * block; shared by every thread of the region. Rows "grouped" are the m * top_k (token,
 * slot) pairs in expert order. */
struct MoEWork {
    float *logits;      /* [m, E]: router logits, then the probabilities (in place) */
    float *weights;     /* [m, k] */
    int64_t *experts;   /* [m, k] */
    int64_t *start;     /* [E + 1]: expert e owns grouped rows [start[e], start[e + 1]) */
    int64_t *cursor;    /* [E]: the counting sort's next free row per expert */
    int64_t *active;    /* [E + 1]: the count of experts with rows, then those experts */
    int64_t *pair;      /* [m * k]: the pair t * k + s of each grouped row */
    int64_t *row_of;    /* [m * k]: the grouped row of each pair */
    float *xg;          /* [m * k, hidden]: float inputs of kinds 0/1, then every output */
    float *gu;          /* [m * k, 2 * intermediate] */
    float *act;         /* [m * k, intermediate] */
    QuantBuffers quant; /* m * k rows of max(hidden, intermediate): kinds 2/3's inputs */
    QuantBuffers x1;    /* one row of hidden: a decode step's token for every expert (below) */
};

static MoEWork *moe_work_new(int64_t m, int64_t e, int64_t k, int64_t hidden, int64_t inter) {
    MoEWork *w = (MoEWork *)malloc(sizeof(MoEWork));
    const int64_t rows = m * k, widest = hidden > inter ? hidden : inter;
    w->logits = (float *)malloc((size_t)(m * e) * sizeof(float));
    w->weights = (float *)malloc((size_t)rows * sizeof(float));
    w->experts = (int64_t *)malloc((size_t)rows * sizeof(int64_t));
    w->start = (int64_t *)malloc((size_t)(e + 1) * sizeof(int64_t));
    w->cursor = (int64_t *)malloc((size_t)e * sizeof(int64_t));
    w->active = (int64_t *)malloc((size_t)(e + 1) * sizeof(int64_t));
    w->pair = (int64_t *)malloc((size_t)rows * sizeof(int64_t));
    w->row_of = (int64_t *)malloc((size_t)rows * sizeof(int64_t));
    w->xg = (float *)malloc((size_t)(rows * hidden) * sizeof(float));
    w->gu = (float *)malloc((size_t)(rows * 2 * inter) * sizeof(float));
    w->act = (float *)malloc((size_t)(rows * inter) * sizeof(float));
    w->quant = quant_buffers(rows, widest);
    w->x1 = quant_buffers(1, hidden);
    return w;
}

static void moe_work_free(MoEWork *w) {
    if (!w) return;
    free(w->logits), free(w->weights), free(w->experts), free(w->start), free(w->cursor);
    free(w->active), free(w->pair), free(w->row_of), free(w->xg), free(w->gu), free(w->act);
    free_quant_buffers(w->quant);
    free_quant_buffers(w->x1);
    free(w);
}

static MoEWork *moe_work_for_layers(const LoomDecoderLayer *layers, int64_t num_layers,
                                    int64_t m) {
    int64_t e = 0, k = 0, hidden = 0, inter = 0;
    for (int64_t l = 0; l < num_layers; l++) {
        const LoomMoE *b = layers[l].moe;
        if (!b) continue;
        e = b->num_experts > e ? b->num_experts : e;
        k = b->top_k > k ? b->top_k : k;
        hidden = b->hidden > hidden ? b->hidden : hidden;
        inter = b->intermediate > inter ? b->intermediate : inter;
    }
    return e ? moe_work_new(m, e, k, hidden, inter) : NULL;
}

/* One row's routing. MOE_SOFTMAX: p [e] = softmax(logits) (p may be logits: each element is
 * read before it is written), then the top k by p, ties to the lower index, into experts [k]
 * and weights [k] (divided by their sum, added in slot order, when renormalize).
 * MOE_TOPK_SOFTMAX: the top k by logit, ties to the lower index, then weights = the softmax of
 * those k logits (max = the first, expf(l - max) summed in slot order; p is the logits).
 * Selection walks the order (value descending, index ascending) one step per slot: slot s
 * takes the first expert after slot s - 1's in that order, so no marks are needed. A NaN
 * logit makes every weight NaN; the experts then stay valid indices (0). */
static void moe_route_row(const float *logits, float *p, int64_t e, int64_t k, int renormalize,
                          int scoring, float *weights, int64_t *experts) {
    if (scoring == MOE_SOFTMAX) {
        float mx = logits[0];
        for (int64_t j = 1; j < e; j++) mx = logits[j] > mx ? logits[j] : mx;
        float sum = 0.0f;
        for (int64_t j = 0; j < e; j++) {
            p[j] = expf(logits[j] - mx);
            sum += p[j];
        }
        for (int64_t j = 0; j < e; j++) p[j] = p[j] / sum;
    } else {
        p = (float *)logits;
    }
    int64_t prev = -1;
    for (int64_t s = 0; s < k; s++) {
        int64_t best = -1;
        for (int64_t j = 0; j < e; j++) {
            if (prev >= 0 && !(p[j] < p[prev] || (p[j] == p[prev] && j > prev))) continue;
            if (best < 0 || p[j] > p[best]) best = j;
        }
        if (best < 0) best = 0;
        experts[s] = best, weights[s] = p[best], prev = best;
    }
    if (scoring == MOE_TOPK_SOFTMAX) {
        const float mx = weights[0];
        float total = 0.0f;
        for (int64_t s = 0; s < k; s++) {
            weights[s] = expf(weights[s] - mx);
            total += weights[s];
        }
        for (int64_t s = 0; s < k; s++) weights[s] = weights[s] / total;
    } else if (renormalize) {
        float total = weights[0];
        for (int64_t s = 1; s < k; s++) total += weights[s];
        for (int64_t s = 0; s < k; s++) weights[s] = weights[s] / total;
    }
}

/* Rows [r0, ...) of a quantised-activation buffer whose rows are k wide. */
static QuantBuffers quant_rows_at(const QuantBuffers *q, int64_t r0, int64_t k) {
    const int64_t nb = k / QBLOCK;
    QuantBuffers at;
    at.xq = q->xq + r0 * k, at.xs = q->xs + r0 * nb, at.xsum = q->xsum + r0 * nb;
    at.xsx = q->xsx + r0 * nb, at.x16 = q->x16 + 2 * r0 * nb;
    return at;
}

/* Quantise row r of a stage's input (k wide) as layer l's kind reads it: kind 2 (w8a8) the
 * int8 blocks; kind 3 (w4a8) those and their sums (w4_act_body's two steps, for one row). */
static inline void moe_quantize_row(const LoomLinear *l, const float *x, int64_t r, int64_t k,
                                    const QuantBuffers *q) {
    if (l->kind != 2 && l->kind != 3) return;
    const int64_t nb = k / QBLOCK;
    quantize_row_q8(x, k, q->xq + r * k, q->xs + r * nb, q->xsum + r * nb);
    if (l->kind == 3) w4_act_finish_row(*q, r, k);
}

/* One expert's layer l on its `rows` grouped rows: float inputs x (kinds 0/1) or their
 * quantised form q (kinds 2/3, already filled), outputs y [rows, out_features]. Kinds 2/3
 * end without a barrier; kinds 0/1 run their bodies (which end in one). */
static void moe_linear_rows(const LoomLinear *l, const float *x, const QuantBuffers *q,
                            int64_t rows, float *y) {
    const int64_t k = l->in_features, n = l->out_features;
    if (l->kind == 0) {
        f32_body(x, rows, k, (const float *)l->weight, l->bias, n, y);
    } else if (l->kind == 1) {
        w8_body(x, rows, k, (const int8_t *)l->weight, l->scale, l->bias, n, y);
    } else if (l->kind == 2) {
        w8a8_tasks(q->xq, q->xs, q->xsum, rows, k, (const uint8_t *)l->weight, l->scale,
                        l->bias, n, y);
    } else { /* w4_linear_segments_body without its barrier */
        const W4Segments *segs = (const W4Segments *)l->weight;
        int64_t y0 = 0;
        for (int64_t i = 0; i < segs->count; i++) {
            w4_segment_body(segs->types[i], q, rows, k, segs->packed[i], segs->columns[i],
                            l->bias ? l->bias + y0 : NULL, y + y0, n);
            y0 += segs->columns[i];
        }
    }
}

/* One stage (gate_up or down) of every expert with rows, in expert order: layers[e] on
 * grouped rows [start[e], start[e + 1]) of x / q (k = in_features wide) into y (n wide). */
static void moe_stage_body(const LoomLinear *layers, const float *x, const QuantBuffers *q,
                           int64_t k, float *y, int64_t n, const MoEWork *w) {
    for (int64_t i = 1; i <= w->active[0]; i++) {
        const int64_t e = w->active[i], r0 = w->start[e];
        const QuantBuffers qe = quant_rows_at(q, r0, k);
        moe_linear_rows(&layers[e], x + r0 * k, &qe, w->start[e + 1] - r0, y + r0 * n);
    }
#pragma omp barrier
}

/* A decode step (m = 1) whose chosen experts are all w4a8, one row each (distinct: a NaN
 * step chooses expert 0 k times), and split evenly over the threads runs "whole experts":
 * each thread takes a contiguous share of the active experts and runs each one's gate_up,
 * activation and down alone, so a thread reads one long stream per weight matrix instead
 * of half of every matrix, with no barrier between the stages. A thread alone computes
 * every column group of a segment with the tile w4_segment_body gives one row (one group a
 * tile, prefetching): the same arithmetic per output, so the same bits.
 * Every thread decides the same (it reads only what the grouping shared). */
static int moe_whole_experts(const LoomMoE *moe, int64_t m, const MoEWork *w) {
    if (m != 1 || w->active[0] != moe->top_k || w->active[0] % omp_get_num_threads())
        return 0;
    for (int64_t i = 1; i <= w->active[0]; i++) {
        const int64_t e = w->active[i];
        if (moe->gate_up[e].kind != 3 || moe->down[e].kind != 3) return 0;
    }
    return 1;
}

/* w4a8 layer l on the one quantised row q into y [out_features], by the calling thread. */
static void moe_w4_row_alone(const LoomLinear *l, const QuantBuffers *q, float *y) {
    const W4Segments *segs = (const W4Segments *)l->weight;
    const int64_t k = l->in_features, ny = l->out_features;
    int64_t y0 = 0;
    for (int64_t i = 0; i < segs->count; i++) {
        const int64_t n = segs->columns[i], groups = (n + COLS - 1) / COLS;
        const float *bias = l->bias ? l->bias + y0 : NULL;
        for (int64_t g = 0; g < groups; g++)
            w4_tile_any(segs->types[i], q, 0, 1, k, segs->packed[i], g, 1, n, bias, y + y0, ny,
                        1);
        y0 += n;
    }
}

/* The block for x [m, hidden] into y [m, hidden] (y may be x: x is last read before y is
 * first written), called by every thread of the enclosing parallel region; w sized for at
 * least m tokens of this block. */
static void moe_block_body(const LoomMoE *moe, const float *x, int64_t m, float *y,
                           const MoEWork *w) {
    const int64_t ne = moe->num_experts, k = moe->top_k, hid = moe->hidden;
    const int64_t inter = moe->intermediate, pairs = m * k;
    const GatedAct act = {moe->activation, moe->act_alpha, moe->act_limit};

    /* Route every token. */
    f32_body(x, m, hid, moe->router, moe->router_bias, ne, w->logits);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < m; t++)
        moe_route_row(w->logits + t * ne, w->logits + t * ne, ne, k, moe->renormalize,
                      moe->scoring, w->weights + t * k, w->experts + t * k);

    /* Group the pairs by expert (a counting sort: pairs in index order keep tokens
     * ascending within an expert); one thread, the result shared after the barrier. */
#pragma omp single
    {
        int64_t *start = w->start, *cursor = w->cursor, active = 0;
        for (int64_t e = 0; e <= ne; e++) start[e] = 0;
        for (int64_t p = 0; p < pairs; p++) start[w->experts[p] + 1]++;
        for (int64_t e = 0; e < ne; e++) {
            if (start[e + 1]) w->active[++active] = e;
            start[e + 1] += start[e];
            cursor[e] = start[e];
        }
        w->active[0] = active;
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t row = cursor[w->experts[p]]++;
            w->pair[row] = p, w->row_of[p] = row;
        }
        /* whole experts: the token's quantised row, once for every expert's gate_up */
        if (moe_whole_experts(moe, m, w)) moe_quantize_row(&moe->gate_up[w->active[1]], x, 0,
                                                           hid, &w->x1);
    }

    if (moe_whole_experts(moe, m, w)) {
        /* Each thread its share of the experts, gate_up -> activation -> down, its rows'
         * down inputs in quant (the gate_up input is x1, so no row another thread reads is
         * written); one barrier before the sum. */
        const int64_t share = w->active[0] / omp_get_num_threads();
        const int64_t first = 1 + omp_get_thread_num() * share;
        for (int64_t i = first; i < first + share; i++) {
            const int64_t e = w->active[i], r = w->start[e];
            float *g = w->gu + r * 2 * inter;
            moe_w4_row_alone(&moe->gate_up[e], &w->x1, g);
            gated_act_row(g, g + inter, inter, act, w->act + r * inter);
            moe_quantize_row(&moe->down[e], w->act + r * inter, r, inter, &w->quant);
            const QuantBuffers qe = quant_rows_at(&w->quant, r, inter);
            moe_w4_row_alone(&moe->down[e], &qe, w->xg + r * hid);
        }
#pragma omp barrier
    } else {
        /* Gather each grouped row's input: quantised for kinds 2/3, copied for kinds 0/1. */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < pairs; r++) {
            const int64_t p = w->pair[r];
            const LoomLinear *l = &moe->gate_up[w->experts[p]];
            const float *xr = x + (p / k) * hid;
            if (l->kind == 2 || l->kind == 3)
                moe_quantize_row(l, xr, r, hid, &w->quant);
            else
                memcpy(w->xg + r * hid, xr, (size_t)hid * sizeof(float));
        }
        moe_stage_body(moe->gate_up, w->xg, &w->quant, hid, w->gu, 2 * inter, w);

        /* The activation, then the down projection's input form of each row. */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < pairs; r++) {
            const float *g = w->gu + r * 2 * inter;
            gated_act_row(g, g + inter, inter, act, w->act + r * inter);
            moe_quantize_row(&moe->down[w->experts[w->pair[r]]], w->act + r * inter, r, inter,
                             &w->quant);
        }
        /* Every expert's output into xg (its inputs were all read in the stage before). */
        moe_stage_body(moe->down, w->act, &w->quant, inter, w->xg, hid, w);
    }

    /* y[t] = sum over the slots in slot order of output * weight (mul, then add). */
#pragma omp for schedule(static)
    for (int64_t t = 0; t < m; t++) {
        const float *wt = w->weights + t * k;
        const int64_t *rows = w->row_of + t * k;
        float *yt = y + t * hid;
        int64_t c = 0;
        for (; c + 8 <= hid; c += 8) {
            __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(w->xg + rows[0] * hid + c),
                                       _mm256_set1_ps(wt[0]));
            for (int64_t s = 1; s < k; s++)
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(w->xg + rows[s] * hid + c),
                                                       _mm256_set1_ps(wt[s])));
            _mm256_storeu_ps(yt + c, acc);
        }
        for (; c < hid; c++) {
            float acc = w->xg[rows[0] * hid + c] * wt[0];
            for (int64_t s = 1; s < k; s++) acc = acc + w->xg[rows[s] * hid + c] * wt[s];
            yt[c] = acc;
        }
    }
}

/* weights [m, k] and experts [m, k] of the router logits [m, e], routed as the block routes
 * (moe_route_row: `scoring` MOE_SOFTMAX or MOE_TOPK_SOFTMAX, ties to the lower index,
 * renormalised when asked). */
LOOM_EXPORT void loom_moe_route(const float *logits, int64_t m, int64_t e, int64_t k,
                                int32_t renormalize, int32_t scoring, float *weights,
                                int64_t *experts) {
    float *p = (float *)malloc((size_t)(m * e) * sizeof(float));
#pragma omp parallel for schedule(static) if (m > 8)
    for (int64_t t = 0; t < m; t++)
        moe_route_row(logits + t * e, p + t * e, e, k, renormalize, scoring, weights + t * k,
                      experts + t * k);
    free(p);
}

/* y [m, hidden] = the block of x [m, hidden] (y may be x), in one parallel region. */
LOOM_EXPORT void loom_moe_ffn(const LoomMoE *moe, const float *x, int64_t m, float *y) {
    if (m <= 0) return;
    MoEWork *w = moe_work_new(m, moe->num_experts, moe->top_k, moe->hidden, moe->intermediate);
#pragma omp parallel
    moe_block_body(moe, x, m, y, w);
    moe_work_free(w);
}
