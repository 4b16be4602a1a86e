/* The fused decoder layer (a step's layers in one parallel region).
 * A part of cpu_kernels.c's one translation unit: it may use what common.h and the parts
 * included before it define. */

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

/* The mixture-of-experts feed-forward block (defined in moe.c, a later part: it runs the
 * kernels of the parts after this one). */
typedef struct LoomMoE LoomMoE;
typedef struct MoEWork MoEWork;

/* A pre-norm decoder layer (Llama, Qwen2/3) or, with sandwich_norms, Gemma's layer with norms
 * after attention and after the MLP as well. Norms compute x / rms(x) * (w + norm_offset).
 * With moe set, the feed-forward block is that mixture of experts (gate_up and down unused;
 * intermediate is the experts' width). */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps, norm_offset;
    int32_t activation;     /* GatedAct codes: 0 silu, 1 tanh-GELU, 2 clamped SwiGLU */
    int32_t sandwich_norms; /* 1: x + norm(attn), x + norm(mlp); 0: x + attn, x + mlp */
    float attn_scale, softcap; /* softcap 0 = off */
    int64_t window;            /* 0 = full attention */
    LoomLinear qkv, o, gate_up, down;
    const float *input_norm, *post_attn_norm, *pre_ffn_norm, *post_ffn_norm;
    const float *q_norm, *k_norm; /* NULL: no QK norm */
    const LoomMoE *moe;           /* NULL: the dense gated MLP */
    const float *sinks;           /* NULL, or [heads]: attention sinks (attention.c) */
    float act_alpha, act_limit;   /* the clamped SwiGLU's (activation 2) */
    int32_t qk_norm_all_heads;    /* 1: q_norm / k_norm span a token's whole q / k (OLMoE);
                                   * 0: each head's head_dim features */
} LoomDecoderLayer;

/* moe.c: the block body (every thread of the region calls it; y may be x) and its workspace
 * for m tokens of any of these layers (NULL where none has experts). */
static void moe_block_body(const LoomMoE *moe, const float *x, int64_t m, float *y,
                           const MoEWork *w);
static MoEWork *moe_work_for_layers(const LoomDecoderLayer *layers, int64_t num_layers,
                                    int64_t m);
static void moe_work_free(MoEWork *w);

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

/* A gated activation a = act(g, u) as the kernels run it: code 0 SiLU(g) * u, 1 tanh-GELU(g)
 * * u, 2 gpt-oss's clamped SwiGLU: g' = min(g, limit), u' = clamp(u, -limit, limit),
 * a = (u' + 1) * (g' * sigmoid(alpha * g')) (alpha, limit unused by codes 0 and 1). */
typedef struct {
    int32_t code;
    float alpha, limit;
} GatedAct;

/* act(g, u) for 8 lanes: tanh(y) = 1 - 2 / (exp(2y) + 1); x * sigmoid(y) = x / (1 + exp(-y)). */
static inline __m256 gated_act256(__m256 g, __m256 u, GatedAct act) {
    const __m256 one = _mm256_set1_ps(1.0f);
    if (act.code == 1) {
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
    if (act.code == 2) {
        const __m256 lim = _mm256_set1_ps(act.limit);
        g = _mm256_min_ps(g, lim);
        u = _mm256_max_ps(_mm256_min_ps(u, lim), _mm256_sub_ps(_mm256_setzero_ps(), lim));
        const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(),
                                              _mm256_mul_ps(g, _mm256_set1_ps(act.alpha))));
        return _mm256_mul_ps(_mm256_add_ps(u, one), _mm256_div_ps(g, _mm256_add_ps(one, e)));
    }
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
}

/* gated_act256 for one value (the rows' tails). */
static inline float gated_act1(float g, float u, GatedAct act) {
    if (act.code == 1) return gelu_tanh(g) * u;
    if (act.code == 2) {
        g = g < act.limit ? g : act.limit;
        u = u < act.limit ? (u > -act.limit ? u : -act.limit) : act.limit;
        return (u + 1.0f) * (g / (1.0f + expf(-(g * act.alpha))));
    }
    return g / (1.0f + expf(-g)) * u;
}

/* a[j] = act(g[j], u[j]) for one row of `inter` values: gated_act256 on 8 lanes at a time,
 * then the scalar tail. The one activation code of the dense FFN, the experts and
 * `loom_gated_act` (so all give the same bits). */
static inline void gated_act_row(const float *g, const float *u, int64_t inter, GatedAct act,
                                 float *a) {
    int64_t j = 0;
    for (; j + 8 <= inter; j += 8)
        _mm256_storeu_ps(a + j, gated_act256(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j),
                                             act));
    for (; j < inter; j++) a[j] = gated_act1(g[j], u[j], act);
}

/* out[r] = act(gate) * up of each row gu[r] = gate | up ([m, 2 * inter] -> [m, inter]): the
 * activation the fused decoder and the MoE block run (the tests' oracle composes with it). */
LOOM_EXPORT void loom_gated_act(const float *gu, int64_t m, int64_t inter, int32_t activation,
                                float alpha, float limit, float *out) {
    const GatedAct act = {activation, alpha, limit};
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; r++)
        gated_act_row(gu + r * 2 * inter, gu + r * 2 * inter + inter, inter, act,
                      out + r * inter);
}

/* Buffers one layer needs, shared by the threads of the step's parallel region. */
typedef struct {
    float *h, *qkv, *q, *k, *q_rot, *k_rot, *attn, *gu, *act;
    QuantBuffers quant;
    const MoEWork *moe; /* the MoE layers' buffers (NULL: no layer has experts) */
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
    if (L->q_norm) {
        const int all = L->qk_norm_all_heads;
        rms_norm_body(ws->q, all ? m : m * L->heads, all ? qd : d, L->q_norm, L->norm_offset,
                      L->eps, NULL, ws->q);
    }
    if (L->k_norm) {
        const int all = L->qk_norm_all_heads;
        rms_norm_body(ws->k, all ? m : m * L->kv_heads, all ? kd : d, L->k_norm, L->norm_offset,
                      L->eps, NULL, ws->k);
    }
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
                   L->sinks, plan, ws->attn, f16);
    linear_any_body(&L->o, ws->attn, m, ws->h, &ws->quant);
    add_block_output(L, L->post_attn_norm, ws->h, x, m);

    /* Feed-forward block: the dense gated MLP, or the experts (in place on the normed rows). */
    rms_norm_body(x, m, hid, L->pre_ffn_norm, L->norm_offset, L->eps, NULL, ws->h);
    if (L->moe) {
        moe_block_body(L->moe, ws->h, m, ws->h, ws->moe);
    } else {
        linear_any_body(&L->gate_up, ws->h, m, ws->gu, &ws->quant);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            gated_act_row(ws->gu + r * 2 * inter, ws->gu + r * 2 * inter + inter, inter,
                          (GatedAct){L->activation, L->act_alpha, L->act_limit},
                          ws->act + r * inter);
        linear_any_body(&L->down, ws->act, m, ws->h, &ws->quant);
    }
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
    MoEWork *moe_work = moe_work_for_layers(layers, num_layers, m);
    ws.moe = moe_work;
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
    moe_work_free(moe_work);
}
