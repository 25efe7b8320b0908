/* The native stack's attention (included by decoder_layers.c, after the vector exp it uses): one query row of one
 * head over a chunk of keys into a partial, the partials of a row merged, and the KIVI cache's chunks made readable.
 * docs/kv-cache.md says which cache each path reads.
 */

/* Attention runs in chunks of SQ_KV_CHUNK keys (flash-decoding): each (chunk, head) is a task for the OpenMP
 * threads, so a one-row decode step at long context splits along the tokens over every core, and the heads that
 * share a key/value head take its chunk one after another while it is in cache. A task leaves, per query row, a
 * partial: the chunk's scores' max, the sum of their exponentials and the unnormalized weighted value sum; `combine`
 * merges a row's partials in chunk order. Chunk boundaries are fixed positions, so a row's result does not depend
 * on the rows beside it (row independence, above), nor on the thread count. */
#define SQ_KV_CHUNK 256

/* one query row of one head over keys/values 0..len-1 (len <= SQ_KV_CHUNK): into res[hd + 2] the unnormalized
 * sum of exp(s - max) V, then max and the sum of exp(s - max), s = q.K * scaling; p: len floats */
static void attend(const float *q, const float *kb, const float *vb, int64_t len, int64_t hd, float scaling,
                   float *p, float *res) {
    float mx = -INFINITY;
    for (int64_t t = 0; t < len; t++) {
        p[t] = dot(q, kb + t * hd, hd) * scaling;
        if (p[t] > mx) mx = p[t];
    }
    exp_shifted(p, len, mx);
    float sum = 0.f;
    for (int64_t t = 0; t < len; t++) sum += p[t];
    for (int64_t j = 0; j < hd; j++) res[j] = 0.f;
    for (int64_t t = 0; t < len; t++) {
        const float w = p[t];
        const float *v = vb + t * hd;
        for (int64_t j = 0; j < hd; j++) res[j] += w * v[j];
    }
    res[hd] = mx;
    res[hd + 1] = sum;
}

/* a row's partials parts[n][hd + 2] (chunk order) merged: softmax(q.K * scaling) V over all its keys into out[hd] */
static void combine(const float *parts, int64_t n, int64_t hd, float *out) {
    const int64_t stride = hd + 2;
    float top = -INFINITY;
    for (int64_t c = 0; c < n; c++)
        if (parts[c * stride + hd] > top) top = parts[c * stride + hd];
    float den = 0.f;
    for (int64_t j = 0; j < hd; j++) out[j] = 0.f;
    for (int64_t c = 0; c < n; c++) {
        const float *part = parts + c * stride;
        const float w = expf(part[hd] - top);
        den += w * part[hd + 1];
        for (int64_t j = 0; j < hd; j++) out[j] += w * part[j];
    }
    const float inv = 1.f / den;
    for (int64_t j = 0; j < hd; j++) out[j] *= inv;
}

#ifdef __AVX2__
/* n floats (n % 8 == 0) to IEEE half, rounded to nearest even (torch's .half()), and back (exact) */
static inline void to_half(const float *x, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
}
static inline void from_half(const uint16_t *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
}

#endif

#ifdef __AVX512F__
/* 16 floats of a key or value row at `off`: fp32, or fp16 widened (exact) */
static inline __m512 load16(const void *base, int64_t off, const int half) {
    if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off)));
    return _mm512_loadu_ps((const float *)base + off);
}

/* lane j of the result = the sum of v[j]'s 16 lanes, for 16 vectors at once (a transposing tree: pairs of vectors
 * within 128-bit chunks, then pairs of those, then across chunks). Every v[j] is summed in the same order whatever
 * its position j, so a key's score does not depend on where its block starts. */
static inline __m512 sum16(const __m512 *v) {
    __m512 w[8], u[4];
    for (int j = 0; j < 8; j++) /* chunk lanes [a0+a2, b0+b2, a1+a3, b1+b3] of a = v[2j], b = v[2j+1] */
        w[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; j++) /* chunk lane p: that chunk's sum of v[4j + p] */
        u[j] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
    /* chunk c: the chunks of u[c] summed, lane p = v[4c + p] */
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* `attend` (a partial) for a head dim of C * 16 floats. Scores 16 keys at a time: each key's q.k as C FMAs into one
 * vector, the 16 vectors reduced together by `sum16` (a horizontal sum per key was most of the attention's time);
 * the softmax's max and sum in vectors; the weighted value sum held in C registers, every value read once. Per row
 * and head the same operations whatever M: rows stay independent. */
static inline __attribute__((always_inline)) void attend_zmm(const float *q, const void *kb, const void *vb,
                                                             int64_t len, float scaling, float *p, float *res,
                                                             const int C, const int half) {
    __m512 qv[8], acc[8];
    for (int i = 0; i < C; i++) qv[i] = _mm512_loadu_ps(q + 16 * i);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    const __m512 sc = _mm512_set1_ps(scaling);
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t nk = len - t0 < 16 ? len - t0 : 16;
        __m512 v[16];
        for (int u = 0; u < 16; u++) {
            if (u < nk) {
                const int64_t k = (t0 + u) * 16 * C;
                __m512 a = _mm512_mul_ps(qv[0], load16(kb, k, half));
                for (int i = 1; i < C; i++) a = _mm512_fmadd_ps(qv[i], load16(kb, k + 16 * i, half), a);
                v[u] = a;
            } else {
                v[u] = _mm512_setzero_ps();
            }
        }
        const __mmask16 m = tail_mask(nk);
        const __m512 s = _mm512_mul_ps(sum16(v), sc);
        _mm512_mask_storeu_ps(p + t0, m, s);
        mx = _mm512_mask_max_ps(mx, m, mx, s);
    }
    const float top = _mm512_reduce_max_ps(mx);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 m = tail_mask(len - t);
        const __m512 e = vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + t), _mm512_set1_ps(top)));
        _mm512_mask_storeu_ps(p + t, m, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
    }
    const float sum = _mm512_reduce_add_ps(total);
    for (int i = 0; i < C; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        const __m512 w = _mm512_set1_ps(p[t]);
        const int64_t v = t * 16 * C;
        for (int i = 0; i < C; i++) acc[i] = _mm512_fmadd_ps(w, load16(vb, v + 16 * i, half), acc[i]);
    }
    for (int i = 0; i < C; i++) _mm512_storeu_ps(res + 16 * i, acc[i]);
    res[16 * C] = top;
    res[16 * C + 1] = sum;
}
#endif

/* whether `attend_head` reads an fp16 chunk in place (the register version), or needs a tile to widen it into */
static int widens_as_loaded(int64_t hd) {
#ifdef __AVX512F__
    return hd == 64 || hd == 128;
#else
    (void)hd;
    return 0;
#endif
}

/* one query row of one head over one chunk of an fp32 (half = 0) or fp16 (half = 1) cache, a partial into res: the
 * register version for head dims of 64 and 128 (SmolLM2, Qwen2.5), fp16 widened as it is loaded; else `attend` on
 * fp32 rows (an fp16 chunk widened first into `tile`: 2 * SQ_KV_CHUNK * hd floats, keys then values) */
static void attend_head(const float *q, const void *kb, const void *vb, int64_t len, int64_t hd, float scaling,
                        float *p, float *res, int half, float *tile) {
#ifdef __AVX512F__
    if (widens_as_loaded(hd)) {
        if (hd == 64 && half) attend_zmm(q, kb, vb, len, scaling, p, res, 4, 1);
        else if (hd == 64) attend_zmm(q, kb, vb, len, scaling, p, res, 4, 0);
        else if (half) attend_zmm(q, kb, vb, len, scaling, p, res, 8, 1);
        else attend_zmm(q, kb, vb, len, scaling, p, res, 8, 0);
        return;
    }
#endif
#ifdef __AVX2__
    if (half) { /* widened once for the chunk into `tile` (exact), then the fp32 code */
        from_half((const uint16_t *)kb, tile, len * hd);
        from_half((const uint16_t *)vb, tile + SQ_KV_CHUNK * hd, len * hd);
        kb = tile;
        vb = tile + SQ_KV_CHUNK * hd;
    }
#else
    (void)half, (void)tile; /* no stack below AVX2 (sq_decoder_layers returns 2) */
#endif
    attend(q, kb, vb, len, hd, scaling, p, res);
}

#ifdef __AVX2__
/* A KIVI cache (toolkit/kv/quantized_cache.py, one sequence) as attention reads it: per key/value head, positions
 * below `flushed_keys` have keys in groups (codes per token, an fp16 scale and minimum per channel over `group`
 * tokens), those up to `flushed_values` staged keys (INT8 per token in a ring of 2 * group slots, one fp16 scale and
 * minimum per `vgroup` channels); values below `flushed_values` are codes per token (scale and minimum per `vgroup`
 * channels); the first `sink` positions are read from their originals; from `flushed_values` to the cache's length
 * the full-precision window; then this call's new rows, which the stack writes to `k_new` / `v_new`
 * [kv_heads][new_rows][head_dim]: a scratch (new_rows = M) that the Python side appends to the cache after the call
 * (it quantizes what leaves the window), or, where no token leaves the window, the window itself behind its last
 * token (k_new = k_res, new_rows = res_cap, new_at = the tokens it holds); new row m at row new_at + m. */
typedef struct {
    const uint8_t *k_codes, *v_codes;                   /* [kv_heads][key_cap or value_cap][head_dim * bits / 8] */
    const uint16_t *k_scale, *k_min;                    /* [kv_heads][key_cap / group][head_dim] */
    const uint16_t *v_scale, *v_min;                    /* [kv_heads][value_cap][head_dim / vgroup] */
    const uint8_t *k8_codes;                            /* [kv_heads][2 * group][head_dim] */
    const uint16_t *k8_scale, *k8_min;                  /* [kv_heads][2 * group][head_dim / vgroup] */
    const float *k_res, *v_res;                         /* [kv_heads][res_cap][head_dim] */
    const float *k_sink, *v_sink;                       /* [kv_heads][sink_cap][head_dim], or NULL */
    float *k_new, *v_new;                               /* [kv_heads][new_rows][head_dim]: written by the stack */
} sq_kvq_layer;

typedef struct {
    int64_t bits, group, vgroup, flushed_keys, flushed_values, sink, key_cap, value_cap, res_cap, sink_cap;
    int64_t new_rows, new_at;
    /* 1: the stack's products take int8 activations (engine.native_dot=int8, a draft's stack), and the grouped codes
     * are read in integers too (`kivi_int_scores`, where built); 0: in fp32 */
    int64_t int_scores;
} sq_kvq;

/* codes of one row (`bits` each, packed lowest bits first along the channels) times scale plus minimum, into
 * out[hd] in fp32: scale and minimum fp16, one per channel (per == 1) or one per `per` channels (a multiple of 8) */
static void dequant_row(const uint8_t *codes, int64_t bits, const uint16_t *scale, const uint16_t *mn, int64_t per,
                        int64_t hd, float *out) {
    const __m256i shift = bits == 4 ? _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)
                                    : _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    const __m256i mask = _mm256_set1_epi32(bits == 4 ? 15 : 3);
    for (int64_t j = 0; j < hd; j += 8) {
        __m256i c;
        if (bits == 8) {
            c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + j)));
        } else if (bits == 4) { /* 8 codes in 4 bytes: code i in bits 4i..4i+3 of the little-endian word */
            uint32_t w;
            memcpy(&w, codes + j / 2, 4);
            c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), shift), mask);
        } else {
            uint16_t w;
            memcpy(&w, codes + j / 4, 2);
            c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), shift), mask);
        }
        __m256 s, m;
        if (per == 1) {
            s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + j)));
            m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + j)));
        } else {
            s = _mm256_set1_ps(_cvtsh_ss(scale[j / per]));
            m = _mm256_set1_ps(_cvtsh_ss(mn[j / per]));
        }
        _mm256_storeu_ps(out + j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), s, m));
    }
}

/* keys and values of positions t0..t1-1 of key/value head `kvh` in fp32, into kt and vt [t1 - t0][hd]: what each
 * position holds whatever the rows that read it (row independence) */
static void fill_chunk(const sq_kvq_layer *L, const sq_kvq *q, int64_t kvh, int64_t t0, int64_t t1, int64_t start,
                       int64_t hd, float *kt, float *vt) {
    const int64_t rowb = hd * q->bits / 8, G = q->group, ring = 2 * G, vpr = hd / q->vgroup;
    const int64_t Tk = q->flushed_keys, Tv = q->flushed_values;
    const size_t row = sizeof(float) * hd;
    for (int64_t t = t0; t < t1; t++) {
        float *kr = kt + (t - t0) * hd, *vr = vt + (t - t0) * hd;
        if (t >= start) {
            memcpy(kr, L->k_new + (kvh * q->new_rows + q->new_at + t - start) * hd, row);
            memcpy(vr, L->v_new + (kvh * q->new_rows + q->new_at + t - start) * hd, row);
        } else if (t >= Tv) {
            memcpy(kr, L->k_res + (kvh * q->res_cap + t - Tv) * hd, row);
            memcpy(vr, L->v_res + (kvh * q->res_cap + t - Tv) * hd, row);
        } else if (t < q->sink) {
            memcpy(kr, L->k_sink + (kvh * q->sink_cap + t) * hd, row);
            memcpy(vr, L->v_sink + (kvh * q->sink_cap + t) * hd, row);
        } else {
            if (t < Tk) {
                const int64_t at = kvh * (q->key_cap / G) + t / G;
                dequant_row(L->k_codes + (kvh * q->key_cap + t) * rowb, q->bits, L->k_scale + at * hd,
                            L->k_min + at * hd, 1, hd, kr);
            } else {
                const int64_t at = kvh * ring + t % ring;
                dequant_row(L->k8_codes + at * hd, 8, L->k8_scale + at * vpr, L->k8_min + at * vpr, q->vgroup, hd,
                            kr);
            }
            const int64_t at = kvh * q->value_cap + t;
            dequant_row(L->v_codes + at * rowb, q->bits, L->v_scale + at * vpr, L->v_min + at * vpr, q->vgroup, hd,
                        vr);
        }
    }
}
#endif

#ifdef __AVX512F__
/* One key/value head of a KIVI cache for `attend_kivi_zmm`: its buffers offset to the head and the strides, so that
 * reading a position costs no division. Positions go straight into registers (C of them: head dim 16 C), without a
 * chunk tile, where the value groups are whole registers (vgroup % 16 == 0). The same values `fill_chunk` writes. */
typedef struct {
    const uint8_t *k_codes, *v_codes, *k8_codes;
    const uint16_t *k_scale, *k_min, *v_scale, *v_min, *k8_scale, *k8_min;
    const float *k_res, *v_res, *k_sink, *v_sink, *k_new, *v_new;
    int64_t start, flushed_keys, flushed_values, sink, bits, rowb, vpr, vg_shift, group_shift, ring_mask;
    int64_t int_scores, int_values; /* `kivi_int_scores`; and values too, where a value group fills registers */
} kivi_src;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SQ_INT_SCORES 1
#endif

/* whether the grouped keys' scores are taken in integers (`int_query`): asked for (int8 activations), built with
 * VNNI, 8- or 4-bit codes, and key groups of whole 16-key blocks */
static int kivi_int_scores(const sq_kvq *q) {
#ifdef SQ_INT_SCORES
    return q->int_scores && (q->bits == 8 || q->bits == 4) && q->group >= 16;
#else
    (void)q;
    return 0;
#endif
}

static kivi_src kivi_head(const sq_kvq_layer *L, const sq_kvq *q, int64_t kvh, int64_t start, int64_t hd) {
    kivi_src s;
    const int64_t rowb = hd * q->bits / 8, vpr = hd / q->vgroup, ring = 2 * q->group;
    int64_t shift = 0, vg_shift = 0;
    while (((int64_t)1 << shift) < q->group) shift++;
    while (((int64_t)1 << vg_shift) < q->vgroup) vg_shift++;
    s.k_codes = L->k_codes + kvh * q->key_cap * rowb;
    s.v_codes = L->v_codes + kvh * q->value_cap * rowb;
    s.k8_codes = L->k8_codes + kvh * ring * hd;
    s.k_scale = L->k_scale + kvh * (q->key_cap / q->group) * hd;
    s.k_min = L->k_min + kvh * (q->key_cap / q->group) * hd;
    s.v_scale = L->v_scale + kvh * q->value_cap * vpr;
    s.v_min = L->v_min + kvh * q->value_cap * vpr;
    s.k8_scale = L->k8_scale + kvh * ring * vpr;
    s.k8_min = L->k8_min + kvh * ring * vpr;
    s.k_res = L->k_res + kvh * q->res_cap * hd;
    s.v_res = L->v_res + kvh * q->res_cap * hd;
    s.k_sink = L->k_sink ? L->k_sink + kvh * q->sink_cap * hd : NULL;
    s.v_sink = L->v_sink ? L->v_sink + kvh * q->sink_cap * hd : NULL;
    s.k_new = L->k_new + (kvh * q->new_rows + q->new_at) * hd;
    s.v_new = L->v_new + (kvh * q->new_rows + q->new_at) * hd;
    s.start = start, s.flushed_keys = q->flushed_keys, s.flushed_values = q->flushed_values, s.sink = q->sink;
    s.bits = q->bits, s.rowb = rowb, s.vpr = vpr, s.vg_shift = vg_shift, s.group_shift = shift, s.ring_mask = ring - 1;
    s.int_scores = kivi_int_scores(q);
    s.int_values = s.int_scores && q->vgroup >= 32;
    return s;
}

/* 16 codes of `bits` from a row at code index j (j % 16 == 0), as floats */
static inline __m512 codes16(const uint8_t *row, int64_t j, const int64_t bits) {
    __m128i b;
    if (bits == 8) {
        b = _mm_loadu_si128((const __m128i *)(row + j));
    } else if (bits == 4) { /* 8 bytes: low nibble then high nibble of each, in order */
        const __m128i x = _mm_loadl_epi64((const __m128i *)(row + j / 2)), low = _mm_set1_epi8(15);
        b = _mm_unpacklo_epi8(_mm_and_si128(x, low), _mm_and_si128(_mm_srli_epi16(x, 4), low));
    } else {
        uint32_t w;
        memcpy(&w, row + j / 4, 4);
        return _mm512_cvtepi32_ps(_mm512_and_si512(
            _mm512_srlv_epi32(_mm512_set1_epi32((int)w), _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22,
                                                                            24, 26, 28, 30)),
            _mm512_set1_epi32(3)));
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
}

/* a whole row's codes into r[C] (C % 4 == 0): 64 4-bit codes from each 32 bytes at once (a quarter of the unpacking
 * steps of `codes16`, the same values); other widths 16 at a time */
static inline __attribute__((always_inline)) void codes_row(const uint8_t *row, const int64_t bits, __m512 *r,
                                                            const int C) {
    if (bits != 4) {
        for (int i = 0; i < C; i++) r[i] = codes16(row, 16 * i, bits);
        return;
    }
    const __m256i low = _mm256_set1_epi8(15);
    for (int i = 0; i < C; i += 4) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(row + 8 * i));
        const __m256i lo = _mm256_and_si256(x, low), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
        /* per 128-bit lane, bytes interleaved low, high: a = codes 0-15 | 32-47, b = 16-31 | 48-63 */
        const __m256i a = _mm256_unpacklo_epi8(lo, hi), b = _mm256_unpackhi_epi8(lo, hi);
        r[i] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(a)));
        r[i + 1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(b)));
        r[i + 2] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(a, 1)));
        r[i + 3] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(b, 1)));
    }
}

static inline __m512 half16(const uint16_t *x) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)x)); }

/* a full-precision row of position t (the new rows, the window, the sinks), or NULL: its codes are read */
static inline const float *kivi_fp(const kivi_src *s, int64_t t, const int value, int64_t hd) {
    if (t >= s->start) return (value ? s->v_new : s->k_new) + (t - s->start) * hd;
    if (t >= s->flushed_values) return (value ? s->v_res : s->k_res) + (t - s->flushed_values) * hd;
    if (t < s->sink) return (value ? s->v_sink : s->k_sink) + t * hd;
    return NULL;
}

/* codes times a scale and minimum per `per` registers (fp16 sc, mn: one per value group) into r[C] */
static inline __attribute__((always_inline)) void grouped_row(const uint8_t *row, int64_t bits, const uint16_t *sc,
                                                              const uint16_t *mn, int64_t vg_shift, __m512 *r,
                                                              const int C) {
    __m512 s = _mm512_setzero_ps(), m = s;
    codes_row(row, bits, r, C);
    for (int i = 0; i < C; i++) { /* channels 16 i.. lie in value group 16 i >> vg_shift (a shift, not a division) */
        const int64_t g = (int64_t)(16 * i) >> vg_shift;
        if (i == 0 || g != ((int64_t)(16 * (i - 1)) >> vg_shift)) {
            s = _mm512_set1_ps(_cvtsh_ss(sc[g]));
            m = _mm512_set1_ps(_cvtsh_ss(mn[g]));
        }
        r[i] = _mm512_fmadd_ps(r[i], s, m);
    }
}

/* keys of positions t .. t + n - 1 (n <= 16) into the tile kt[n][16 C]: a block inside one key group converts its
 * scales and minima once */
static inline __attribute__((always_inline)) void kivi_keys(const kivi_src *s, int64_t t, int64_t n, float *kt,
                                                            const int C) {
    const int64_t hd = 16 * C;
    if (t >= s->sink && t + n <= s->flushed_keys && (t >> s->group_shift) == ((t + n - 1) >> s->group_shift)) {
        const int64_t g = t >> s->group_shift;
        __m512 sc[8], mn[8];
        for (int i = 0; i < C; i++) {
            sc[i] = half16(s->k_scale + g * hd + 16 * i);
            mn[i] = half16(s->k_min + g * hd + 16 * i);
        }
        for (int64_t u = 0; u < n; u++) {
            __m512 r[8];
            codes_row(s->k_codes + (t + u) * s->rowb, s->bits, r, C);
            for (int i = 0; i < C; i++) _mm512_storeu_ps(kt + u * hd + 16 * i, _mm512_fmadd_ps(r[i], sc[i], mn[i]));
        }
        return;
    }
    for (int64_t u = 0; u < n; u++) {
        const int64_t p = t + u;
        const float *fp = kivi_fp(s, p, 0, hd);
        __m512 r[8];
        if (fp) {
            for (int i = 0; i < C; i++) r[i] = _mm512_loadu_ps(fp + 16 * i);
        } else if (p < s->flushed_keys) {
            const int64_t g = p >> s->group_shift;
            const uint8_t *row = s->k_codes + p * s->rowb;
            for (int i = 0; i < C; i++)
                r[i] = _mm512_fmadd_ps(codes16(row, 16 * i, s->bits), half16(s->k_scale + g * hd + 16 * i),
                                       half16(s->k_min + g * hd + 16 * i));
        } else { /* staged: INT8 per token in the ring */
            const int64_t at = p & s->ring_mask;
            grouped_row(s->k8_codes + at * hd, 8, s->k8_scale + at * s->vpr, s->k8_min + at * s->vpr, s->vg_shift,
                        r, C);
        }
        for (int i = 0; i < C; i++) _mm512_storeu_ps(kt + u * hd + 16 * i, r[i]);
    }
}

/* the value of position t into r[C] */
static inline __attribute__((always_inline)) void kivi_value(const kivi_src *s, int64_t t, __m512 *r, const int C) {
    const float *fp = kivi_fp(s, t, 1, 16 * C);
    if (fp) {
        for (int i = 0; i < C; i++) r[i] = _mm512_loadu_ps(fp + 16 * i);
        return;
    }
    grouped_row(s->v_codes + t * s->rowb, s->bits, s->v_scale + t * s->vpr, s->v_min + t * s->vpr, s->vg_shift, r, C);
}

#ifdef SQ_INT_SCORES
/* Keys' scores on the codes in integers, where the stack's products take int8 activations (engine.native_dot=int8;
 * docs/kv-cache.md "Scores on the codes"). A grouped key is k_j = c_j s_j + m_j (s, m: its key group's per-channel
 * scale and minimum), so q.k = sum_j (q_j s_j) c_j + q.m. Per query row and key group, a_j = q_j s_j is rounded to
 * int16 with one scale (alpha = max |a_j| / 32767) and q.m kept in fp32; a key's score is then
 * alpha * sum_j a'_j c_j + q.m, the sum exact in int32 on vpdpwssd (32 codes widened to 16 bits, times a', an
 * instruction), where the fp32 score costs every code a conversion and two FMAs. int16, not int8 (vpdpbusd): an
 * int8 a' moves the scores more than an int8 cache's own rounding does.
 * An approximation of the fp32 score all the same, made from the row alone: rows stay independent. */
typedef struct {
    int16_t a[128]; /* a'_j in the order `int_codes` widens the codes */
    float alpha, bias;
    int64_t g; /* the key group this is for, -1: none yet */
} int_query;

/* `int_query` of q for key group g. 8-bit codes keep the channel order; 4-bit codes unpack each 64 channels (32
 * bytes) as the low nibbles (the even channels) then the high nibbles (the odd), and a' is ordered the same way. */
static inline __attribute__((always_inline)) void int_query_for(const float *q, const kivi_src *s, int64_t g,
                                                              int_query *iq, const int C) {
    const int64_t hd = 16 * C;
    __m512 a[8], mx = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    for (int i = 0; i < C; i++) {
        const __m512 qv = _mm512_loadu_ps(q + 16 * i);
        a[i] = _mm512_mul_ps(qv, half16(s->k_scale + g * hd + 16 * i));
        mx = _mm512_max_ps(mx, _mm512_abs_ps(a[i]));
        b = _mm512_fmadd_ps(qv, half16(s->k_min + g * hd + 16 * i), b);
    }
    const float top = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(top > 0.f ? 32767.f / top : 0.f);
    if (s->bits == 4) {
        const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        for (int i = 0; i < C; i += 4) {
            const __m512 e0 = _mm512_permutex2var_ps(a[i], even, a[i + 1]);
            const __m512 e1 = _mm512_permutex2var_ps(a[i + 2], even, a[i + 3]);
            const __m512 o0 = _mm512_permutex2var_ps(a[i], odd, a[i + 1]);
            const __m512 o1 = _mm512_permutex2var_ps(a[i + 2], odd, a[i + 3]);
            a[i] = e0, a[i + 1] = e1, a[i + 2] = o0, a[i + 3] = o1;
        }
    }
    for (int i = 0; i < C; i++)
        _mm256_storeu_si256((__m256i *)(iq->a + 16 * i),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a[i], inv))));
    iq->alpha = top / 32767.f;
    iq->bias = _mm512_reduce_add_ps(b);
    iq->g = g;
}

/* the codes of n keys (rows of hd * bits / 8 bytes) widened to 16 bits into tile[n][hd] in `int_query_for`'s order */
static inline __attribute__((always_inline)) void int_codes(const uint8_t *rows, int64_t bits, int64_t n,
                                                          int16_t *tile, const int C) {
    const int64_t hd = 16 * C;
    for (int64_t u = 0; u < n; u++) {
        int16_t *out = tile + u * hd;
        if (bits == 8) {
            for (int i = 0; i < C / 2; i++)
                _mm512_storeu_si512(out + 32 * i, _mm512_cvtepu8_epi16(
                    _mm256_loadu_si256((const __m256i *)(rows + u * hd + 32 * i))));
            continue;
        }
        const __m256i low = _mm256_set1_epi8(15);
        for (int i = 0; i < C / 4; i++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(rows + u * hd / 2 + 32 * i));
            _mm512_storeu_si512(out + 64 * i, _mm512_cvtepu8_epi16(_mm256_and_si256(x, low)));
            _mm512_storeu_si512(out + 64 * i + 32, _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(x, 4),
                                                                                        low)));
        }
    }
}

/* `sum16` in int32 (exact: any order gives the same sums) */
static inline __m512i sum16i(const __m512i *v) {
    __m512i w[8], u[4];
    for (int j = 0; j < 8; j++)
        w[j] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * j], v[2 * j + 1]),
                                _mm512_unpackhi_epi32(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; j++) {
        const __m512 a = _mm512_castsi512_ps(w[2 * j]), b = _mm512_castsi512_ps(w[2 * j + 1]);
        u[j] = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0))),
                                _mm512_castps_si512(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2))));
    }
    const __m512i s01 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                         _mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512i s23 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                         _mm512_shuffle_i32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* the scores alpha * sum a'c + q.m of n keys (n <= 16; their widened codes at tile, hd apart), lanes >= n 0 */
static inline __attribute__((always_inline)) __m512 int_scores16(const int16_t *tile, int64_t n, const int_query *iq,
                                                               const int C) {
    const int64_t hd = 16 * C;
    __m512i a[4], v[16];
    for (int i = 0; i < C / 2; i++) a[i] = _mm512_loadu_si512(iq->a + 32 * i);
    for (int u = 0; u < 16; u++) {
        __m512i acc = _mm512_setzero_si512();
        if (u < n)
            for (int i = 0; i < C / 2; i++)
                acc = _mm512_dpwssd_epi32(acc, _mm512_loadu_si512(tile + u * hd + 32 * i), a[i]);
        v[u] = acc;
    }
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum16i(v)), _mm512_set1_ps(iq->alpha), _mm512_set1_ps(iq->bias));
}

/* Values in integers, beside the keys (where a value group is whole 32-channel registers: vgroup >= 32). A grouped
 * value is v_j = c_j s_t + m_t (s, m: token t's scale and minimum for the group of channel j), so a query's weighted
 * sum over tokens t is sum_t (p_t s_t) c_tj + sum_t p_t m_t. Per query and chunk, w_t = p_t s_t is rounded to int16
 * against its largest in the chunk (w' = w_t W / max w; W = 16383 for 8-bit codes, so that 256 tokens of sums stay
 * inside int32, else 32767: a chunk far from where the query looks keeps its precision too) and the minima's sum
 * kept in fp32; vpdpwssd multiplies
 * a pair of tokens' widened codes, interleaved per channel, by the pair's w' at once. The range taken is the chunk's
 * grouped values every query of the call reads whole (below the window): what a row reads does not depend on the
 * rows beside it. */

/* one value row's codes widened to 16 bits into V[C / 2], channel order */
static inline __attribute__((always_inline)) void int_value_row(const uint8_t *row, int64_t bits, __m512i *V,
                                                              const int C) {
    if (bits == 8) {
        for (int i = 0; i < C / 2; i++) V[i] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + 32 * i)));
        return;
    }
    const __m256i low = _mm256_set1_epi8(15);
    for (int i = 0; i < C / 4; i++) { /* 32 bytes, 64 channels: byte b holds channel 2b (low nibble), 2b + 1 */
        const __m256i x = _mm256_loadu_si256((const __m256i *)(row + 32 * i));
        const __m256i lo = _mm256_and_si256(x, low), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
        const __m256i a = _mm256_unpacklo_epi8(lo, hi), b = _mm256_unpackhi_epi8(lo, hi); /* 0-15|32-47, 16-31|48-63 */
        V[2 * i] = _mm512_cvtepu8_epi16(_mm256_permute2x128_si256(a, b, 0x20));
        V[2 * i + 1] = _mm512_cvtepu8_epi16(_mm256_permute2x128_si256(a, b, 0x31));
    }
}

/* adds the grouped values of chunk positions a .. b - 1 (a, b even; every query reads them all), weighted by each
 * query's p (p + qi * SQ_KV_CHUNK, chunk-relative), into acc[qi] (C registers, channel order) */
static inline __attribute__((always_inline)) void int_value_sums(const kivi_src *s, int64_t t0, int64_t a, int64_t b,
                                                               const float *p, __m512 (*acc)[8], const int Q,
                                                               const int C) {
    const int64_t vpr = s->vpr, n = (b - a) * vpr; /* scales in [token][group] order */
    const float W = s->bits == 8 ? 16383.f : 32767.f;
    const uint16_t *vs = s->v_scale + (t0 + a) * vpr, *vm = s->v_min + (t0 + a) * vpr;
    float fs[4 * SQ_KV_CHUNK + 16], fm[4 * SQ_KV_CHUNK + 16], wf[4 * SQ_KV_CHUNK + 16], back[6][4], M[6][4], inv[16];
    int16_t wq[6][4 * SQ_KV_CHUNK + 16];
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        _mm512_storeu_ps(fs + i, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, vs + i)));
        _mm512_storeu_ps(fm + i, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, vm + i)));
    }
    const __mmask16 lanes = vpr == 1 ? 0xFFFF : vpr == 2 ? 0x5555 : 0x1111; /* lane l holds group l % vpr */
    /* p repeated per group; w' stored per pair of tokens as [group][token of the pair] */
    const __m512i expand = vpr == 1 ? _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                         : vpr == 2 ? _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)
                                    : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i pairs = vpr == 1 ? expand
                        : vpr == 2 ? _mm512_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15)
                                   : _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    const int64_t per = 16 / vpr; /* tokens a vector holds */
    for (int qi = 0; qi < Q; qi++) { /* w = p s, its largest per group, then w' = w W / largest */
        const float *pq = p + qi * SQ_KV_CHUNK + a;
        __m512 macc = _mm512_setzero_ps(), top = macc;
        for (int64_t i = 0; i < n; i += 16) {
            const int64_t tok = (n - i) / vpr;
            const __m512 pv = _mm512_permutexvar_ps(expand, _mm512_maskz_loadu_ps(tail_mask(tok < per ? tok : per),
                                                                                 pq + i / vpr));
            macc = _mm512_fmadd_ps(pv, _mm512_loadu_ps(fm + i), macc);
            const __m512 w = _mm512_mul_ps(pv, _mm512_loadu_ps(fs + i));
            _mm512_storeu_ps(wf + i, w);
            top = _mm512_max_ps(top, w);
        }
        for (int g = 0; g < vpr; g++) {
            const float most = _mm512_mask_reduce_max_ps((__mmask16)(lanes << g), top);
            M[qi][g] = _mm512_mask_reduce_add_ps((__mmask16)(lanes << g), macc);
            back[qi][g] = most / W;
            inv[g] = most > 0.f ? W / most : 0.f;
        }
        for (int l = vpr; l < 16; l++) inv[l] = inv[l % vpr];
        const __m512 invv = _mm512_loadu_ps(inv);
        for (int64_t i = 0; i < n; i += 16) {
            const __m512 w = _mm512_permutexvar_ps(pairs, _mm512_mul_ps(_mm512_loadu_ps(wf + i), invv));
            _mm256_storeu_si256((__m256i *)(wq[qi] + i), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(w)));
        }
    }
    __m512i iacc[6][8];
    for (int qi = 0; qi < Q; qi++)
        for (int k = 0; k < C; k++) iacc[qi][k] = _mm512_setzero_si512();
    for (int64_t t = a; t < b; t += 2) {
        __m512i V0[4], V1[4], P[8];
        int_value_row(s->v_codes + (t0 + t) * s->rowb, s->bits, V0, C);
        int_value_row(s->v_codes + (t0 + t + 1) * s->rowb, s->bits, V1, C);
        for (int r = 0; r < C / 2; r++) { /* 32-bit lane 4k + i: channel 32r + 8k + i (lo), 32r + 8k + 4 + i (hi) */
            P[2 * r] = _mm512_unpacklo_epi16(V0[r], V1[r]);
            P[2 * r + 1] = _mm512_unpackhi_epi16(V0[r], V1[r]);
        }
        for (int qi = 0; qi < Q; qi++) {
            const int16_t *w = wq[qi] + (t - a) * vpr;
            for (int k = 0; k < C; k++) {
                int32_t pair;
                memcpy(&pair, w + 2 * ((32 * (k / 2)) >> s->vg_shift), 4);
                iacc[qi][k] = _mm512_dpwssd_epi32(iacc[qi][k], P[k], _mm512_set1_epi32(pair));
            }
        }
    }
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int qi = 0; qi < Q; qi++)
        for (int r = 0; r < C / 2; r++) {
            const int64_t g = (32 * r) >> s->vg_shift;
            const __m512 f0 = _mm512_mul_ps(_mm512_cvtepi32_ps(iacc[qi][2 * r]), _mm512_set1_ps(back[qi][g]));
            const __m512 f1 = _mm512_mul_ps(_mm512_cvtepi32_ps(iacc[qi][2 * r + 1]), _mm512_set1_ps(back[qi][g]));
            const __m512 m = _mm512_set1_ps(M[qi][g]);
            acc[qi][2 * r] = _mm512_add_ps(acc[qi][2 * r], _mm512_add_ps(_mm512_permutex2var_ps(f0, lo, f1), m));
            acc[qi][2 * r + 1] = _mm512_add_ps(acc[qi][2 * r + 1], _mm512_add_ps(_mm512_permutex2var_ps(f0, hi, f1), m));
        }
}
#endif

/* Q query rows of one key/value head's group over positions t0 .. t0 + lens[i] - 1 of a KIVI chunk: each position
 * read once into registers and used by every query (GQA, and a verify pass's rows). Per query the arithmetic of
 * `attend_zmm` in the same order -- its keys' scores 16 at a time through `sum16`, the softmax, the weighted value sum
 * in registers -- so a row's partial does not depend on the queries beside it. kt: a 16-key tile [16][16 C]; p:
 * [Q][SQ_KV_CHUNK] scores; res[i]: the partials. */
static inline __attribute__((always_inline)) void attend_kivi_zmm(const float *const *qs, const int64_t *lens,
                                                                  const kivi_src *src, int64_t t0, float scaling,
                                                                  float *kt, float *p, float *const *res, const int Q,
                                                                  const int C) {
    __m512 mx[6], acc[6][8];
    int64_t most = 0;
    for (int i = 0; i < Q; i++) {
        mx[i] = _mm512_set1_ps(-INFINITY);
        if (lens[i] > most) most = lens[i];
    }
    const __m512 sc = _mm512_set1_ps(scaling);
#ifdef SQ_INT_SCORES
    int_query iq[6];
    for (int i = 0; i < Q; i++) iq[i].g = -1;
#endif
    for (int64_t b = 0; b < most; b += 16) {
        const int64_t nk = most - b < 16 ? most - b : 16, t = t0 + b;
        if (t + 16 < src->flushed_values) /* this block's values, read once the chunk's keys are scored */
            for (int64_t u = 0; u < 16 * src->rowb; u += 64) {
                _mm_prefetch((const char *)(src->v_codes + t * src->rowb + u), _MM_HINT_T1);
                _mm_prefetch((const char *)(src->k_codes + (t + 128) * src->rowb + u), _MM_HINT_T1);
            }
        if (t + 16 < src->flushed_values) {
            _mm_prefetch((const char *)(src->v_scale + t * src->vpr), _MM_HINT_T1);
            _mm_prefetch((const char *)(src->v_min + t * src->vpr), _MM_HINT_T1);
        }
#ifdef SQ_INT_SCORES
        /* a block of grouped keys (one key group: groups are whole blocks) scored in integers */
        if (src->int_scores && t >= src->sink && t + nk <= src->flushed_keys) {
            int16_t *tile = (int16_t *)kt;
            int_codes(src->k_codes + t * src->rowb, src->bits, nk, tile, C);
            const int64_t g = t >> src->group_shift;
            for (int qi = 0; qi < Q; qi++) {
                const int64_t n = lens[qi] - b < 16 ? lens[qi] - b : 16;
                if (n <= 0) continue;
                if (iq[qi].g != g) int_query_for(qs[qi], src, g, &iq[qi], C);
                const __mmask16 m = tail_mask(n);
                const __m512 s = _mm512_mul_ps(int_scores16(tile, n, &iq[qi], C), sc);
                _mm512_mask_storeu_ps(p + qi * SQ_KV_CHUNK + b, m, s);
                mx[qi] = _mm512_mask_max_ps(mx[qi], m, mx[qi], s);
            }
            continue;
        }
#endif
        kivi_keys(src, t, nk, kt, C);
        for (int qi = 0; qi < Q; qi++) {
            const int64_t n = lens[qi] - b < 16 ? lens[qi] - b : 16;
            if (n <= 0) continue;
            const float *q = qs[qi];
            __m512 v[16];
            for (int u = 0; u < 16; u++) {
                if (u < n) {
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(kt + u * 16 * C));
                    for (int i = 1; i < C; i++)
                        a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * i), _mm512_loadu_ps(kt + u * 16 * C + 16 * i), a);
                    v[u] = a;
                } else {
                    v[u] = _mm512_setzero_ps();
                }
            }
            const __mmask16 m = tail_mask(n);
            const __m512 s = _mm512_mul_ps(sum16(v), sc);
            _mm512_mask_storeu_ps(p + qi * SQ_KV_CHUNK + b, m, s);
            mx[qi] = _mm512_mask_max_ps(mx[qi], m, mx[qi], s);
        }
    }
    float top[6], sum[6];
    for (int qi = 0; qi < Q; qi++) {
        float *pq = p + qi * SQ_KV_CHUNK;
        top[qi] = _mm512_reduce_max_ps(mx[qi]);
        __m512 total = _mm512_setzero_ps();
        for (int64_t t = 0; t < lens[qi]; t += 16) {
            const __mmask16 m = tail_mask(lens[qi] - t);
            const __m512 e = vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, pq + t), _mm512_set1_ps(top[qi])));
            _mm512_mask_storeu_ps(pq + t, m, e);
            total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
        }
        sum[qi] = _mm512_reduce_add_ps(total);
        for (int i = 0; i < C; i++) acc[qi][i] = _mm512_setzero_ps();
    }
    int64_t ia = 0, ib = 0; /* chunk positions whose values `int_value_sums` takes */
#ifdef SQ_INT_SCORES
    if (src->int_values) {
        ia = (src->sink > t0 ? src->sink - t0 + 1 : 0) & ~(int64_t)1;
        ib = (src->flushed_values - t0 < SQ_KV_CHUNK ? src->flushed_values - t0 : SQ_KV_CHUNK) & ~(int64_t)1;
        if (ib > ia) int_value_sums(src, t0, ia, ib, p, acc, Q, C);
        else ia = ib = 0;
    }
#endif
    for (int64_t t = 0; t < most; t++) {
        if (t == ia && ib > ia) t = ib;
        if (t >= most) break;
        __m512 r[8];
        kivi_value(src, t0 + t, r, C);
        for (int qi = 0; qi < Q; qi++) {
            if (t >= lens[qi]) continue;
            const __m512 w = _mm512_set1_ps(p[qi * SQ_KV_CHUNK + t]);
            for (int i = 0; i < C; i++) acc[qi][i] = _mm512_fmadd_ps(w, r[i], acc[qi][i]);
        }
    }
    for (int qi = 0; qi < Q; qi++) {
        for (int i = 0; i < C; i++) _mm512_storeu_ps(res[qi] + 16 * i, acc[qi][i]);
        res[qi][16 * C] = top[qi];
        res[qi][16 * C + 1] = sum[qi];
    }
}

/* the most queries of a (chunk, key/value head) task that `attend_kivi` takes, in batches: beyond, a chunk tile */
#define SQ_KIVI_QUERIES 24

/* the most queries `attend_kivi` takes at once for C registers a row: its accumulators stay in registers */
static inline int kivi_batch(int64_t hd) { return hd == 64 ? 6 : 2; }

/* whether `attend_kivi` runs this cache: head dims 64 and 128, value groups of whole registers (a power of two:
 * a group size, or the head dim) */
static int kivi_in_registers(const sq_kvq *q, int64_t hd) {
    return (hd == 64 || hd == 128) && q->vgroup % 16 == 0 && (q->vgroup & (q->vgroup - 1)) == 0;
}

static void attend_kivi(const float *const *qs, const int64_t *lens, int Q, const kivi_src *src, int64_t t0,
                        int64_t hd, float scaling, float *kt, float *p, float *const *res) {
#define SQ_KIVI(n, c) \
    case n: attend_kivi_zmm(qs, lens, src, t0, scaling, kt, p, res, n, c); break
    if (hd == 64) {
        switch (Q) { SQ_KIVI(1, 4); SQ_KIVI(2, 4); SQ_KIVI(3, 4); SQ_KIVI(4, 4); SQ_KIVI(5, 4); SQ_KIVI(6, 4); }
    } else {
        switch (Q) { SQ_KIVI(1, 8); SQ_KIVI(2, 8); }
    }
#undef SQ_KIVI
}
#endif
