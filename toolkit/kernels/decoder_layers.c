/* A Llama/Qwen2 decoder stack for one sequence in one C call: RMSNorm, fused q,k,v product, rotary, KV cache write,
 * causal attention over the cache, o product, residual, RMSNorm, fused gate,up product, SiLU * up, down product,
 * residual -- for every layer, M new rows at once (a decode step, a speculative verify pass, a short prompt). Driven
 * by toolkit/engine/native_decoder.py, which documents when it runs.
 *
 * Why: on SmolLM2-135M a decode step through torch spends most of its time around ~40 small operators per layer
 * (each a dispatch, an allocation, a thread fork), not in the weights. Here a layer is four GEMMs (int4 weights:
 * int4_gemm.c or vnni_gemm.c, beside this file; int8 weights: int8_gemm.c; fp16 weights, a float model at the
 * engine's default precision: half_gemm.c, or bf16_gemm.c under engine.native_dot=bf16; all included below) and a
 * few loops over a few thousand floats.
 *
 * Exactness: the same model in fp32, not bit-identical to torch's operators (sums are taken in another order);
 * the Python side tests it against transformers' forward within fp32 rounding. What it guarantees instead is row
 * independence: row i's result depends only on the cache and on rows 0..i's keys and values, computed by the same
 * operations in the same order whatever M is -- so a verify pass over k+1 rows gives each row exactly the answer
 * one-row decoding gives, and speculative greedy output is token-identical to the target alone.
 *
 * A draft's stack (spec.act_bits=8) runs its products on the w4a8 kernel instead (vnni_gemm.c: activations rounded
 * to int8 per group, VNNI dot products): row-independent too, but an approximation of the fp32 product, never a
 * target's.
 *
 * Layouts: hidden [M, d] fp32 (updated in place); cos, sin [M, head_dim] (transformers' rotary tables for the rows'
 * positions); each layer's keys and values in [kv_heads, cap, head_dim] fp32 or fp16 buffers (a
 * ContiguousKVLayer's buffers for batch 1; `kv_half`), the new rows written at slots start .. start+M-1. The fused
 * q,k,v product's columns are q (heads*head_dim) | k (kv_heads*head_dim) | v; gate,up's are gate (inter) | up (inter).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_gemm.c"
#include "half_gemm.c"
#include "int4_gemm.c"
#include "int8_gemm.c"
#include "vnni_gemm.c"

typedef struct {
    const uint8_t *codes;
    const float *scale;
    const uint8_t *zero;
    const float *bias; /* NULL: none */
    int64_t n, k, g;
    /* 0: an n8 pack, fp32 activations (int4_gemm.c); 1: a v16 pack, int8 activations (vnni_gemm.c);
     * 2: an h16 pack of fp16 weights in `codes` (half_gemm.c; scale, zero and g unused), fp32 activations;
     * 3: int8 per-channel codes in the h16 order in `codes` and fp32 scales [n] (int8_gemm.c; zero and g unused);
     * 4: a b16 pack of bf16 weights in `codes` (bf16_gemm.c; scale, zero and g unused), activations rounded to bf16;
     * 5: a v16 pack of 8-bit codes, int8 activations (vnni_gemm.c's w8a8: an int8 checkpoint at native_dot=int8) */
    int64_t kind;
    /* NULL, or an act-order product's column order (QuantLinear.in_perm): column j reads input channel perm[j] */
    const int32_t *perm;
} sq_q4;

typedef struct {
    const float *in_norm, *post_norm;
    sq_q4 qkv, o, gate_up, down;
} sq_layer;

typedef struct {
    int64_t d, heads, kv_heads, head_dim, inter, cap;
    float eps, scaling;
    /* 0: the cache's keys and values are fp32; 1: fp16 (IEEE half, rounded to nearest even as torch's .half()),
     * read into fp32 and accumulated in fp32 (docs/kv-cache.md "The float cache in 2 bytes") */
    int64_t kv_half;
} sq_dims;

/* attention runs on the OpenMP threads above this many (head, row, key) scores a layer, serial below. 512: a one-row
 * step of SmolLM2 (9 heads) goes parallel from a ~57-token context. Measured by two builds alternated call by call on
 * the int4 w4a8 self-draft's stack (one row; medians of 4000 calls each): against the former 4096, ctx 40
 * at 256 +83 us (why not lower), ctx 64 at 512 -64 us, ctx 128 at 512 -61..-137 us, ctx 300 at 512 -223 us */
#ifndef SQ_ATTN_PARALLEL_MIN
#define SQ_ATTN_PARALLEL_MIN 512
/* rows from which the per-row steps (norms, SiLU, residual adds) run on the OpenMP threads: a prompt's, not a decode
 * step's or a verify pass's (each row's arithmetic is the same either way) */
#define SQ_ROWS_PARALLEL_MIN 16

/* (an OpenMP region with a false `if` still costs a team of one: decode steps skip it altogether) */
static void add_rows(float *h, const float *p, int64_t n, int64_t M) {
    if (M < SQ_ROWS_PARALLEL_MIN) {
        for (int64_t i = 0; i < n; i++) h[i] += p[i];
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) h[i] += p[i];
}

/* Optional phase timing (benchmarks/ttft_profile.py, docs/engine.md "Where a short prompt's time goes"): off, a
 * branch per phase; on, a clock read per phase (~25 ns, ~10 a layer). Phases: 0 norms and residual adds, 1 the four
 * products, 2 rotary embeddings and the cache writes, 3 attention, 4 SiLU x up. */
#include <time.h>
#define SQ_PHASES 5
static int sq_timing;
static double sq_phase_s[SQ_PHASES];
static inline double sq_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
#define SQ_MARK(phase)                                    \
    do {                                                  \
        if (sq_timing) {                                  \
            const double sq_t = sq_now();                 \
            sq_phase_s[phase] += sq_t - sq_last;          \
            sq_last = sq_t;                               \
        }                                                 \
    } while (0)

/* on != 0: start timing from zero; then (on or off) copy the seconds so far into out[SQ_PHASES] if out != NULL */
void sq_decoder_timing(int on, double *out) {
    if (out) memcpy(out, sq_phase_s, sizeof(sq_phase_s));
    if (on && !sq_timing) memset(sq_phase_s, 0, sizeof(sq_phase_s));
    sq_timing = on;
}
#endif

static int q4_ordered(const sq_q4 *w, const float *x, int64_t M, float *y) {
    if (w->kind == 4) return sq_b16_linear(x, M, w->k, (const uint16_t *)w->codes, w->bias, w->n, y);
    if (w->kind == 3) return sq_int8_linear(x, M, w->k, (const int8_t *)w->codes, w->scale, w->bias, w->n, y);
    if (w->kind == 2) return sq_f16_linear(x, M, w->k, (const uint16_t *)w->codes, w->bias, w->n, y);
    if (w->kind == 5) return sq_w8a8_linear(x, M, w->k, w->codes, w->scale, w->zero, w->bias, w->n, w->g, y);
    if (w->kind == 1) return sq_w4a8_linear(x, M, w->k, w->codes, w->scale, w->zero, w->bias, w->n, w->g, y);
    return sq_int4_linear(x, M, w->k, w->codes, w->scale, w->zero, w->bias, w->n, w->g, y);
}

static int q4(const sq_q4 *w, const float *x, int64_t M, float *y) {
    if (w->perm) { /* act-order: the rows' inputs gathered into the columns' order first */
        float *xp = malloc(sizeof(float) * (size_t)(M * w->k + 1));
        if (!xp) return 3;
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < w->k; j++) xp[m * w->k + j] = x[m * w->k + w->perm[j]];
        const int rc = q4_ordered(w, xp, M, y);
        free(xp);
        return rc;
    }
    return q4_ordered(w, x, M, y);
}

#ifdef __AVX512F__
/* the first `left` of 16 lanes (all 16 from 16 on) */
static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}
#endif


/* transformers' apply_rotary_pos_emb for one head: x*cos + rotate_half(x)*sin, rotate_half(x) = cat(-x2, x1) */
static void rotate(const float *x, const float *c, const float *s, int64_t hd, float *out) {
    const int64_t h = hd / 2;
    for (int64_t j = 0; j < h; j++) out[j] = x[j] * c[j] - x[j + h] * s[j];
    for (int64_t j = h; j < hd; j++) out[j] = x[j] * c[j] + x[j - h] * s[j];
}

#ifdef __AVX2__
static inline float dot(const float *a, const float *b, int64_t n) { /* n % 8 == 0; fixed order */
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
#endif

/* y = w * (x * (1 / sqrt(mean(x^2) + eps))), per row; the sum of squares in fixed order (16 lane sums, then the
 * lanes: a scalar chain of d dependent adds cost ~0.9 ms of a 6-row SmolLM2 verify pass) */
static void rms_norm_rows(const float *x, const float *w, int64_t m0, int64_t m1, int64_t d, float eps, float *y) {
    for (int64_t m = m0; m < m1; m++) {
        const float *xr = x + m * d;
#ifdef __AVX512F__
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            const __m512 v = _mm512_maskz_loadu_ps(tail_mask(d - i), xr + i);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        const float ss = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
        const int64_t d8 = d & ~(int64_t)7;  /* 8 lane sums, then the lanes, then the rest in order */
        float ss = dot(xr, xr, d8);
        for (int64_t i = d8; i < d; i++) ss += xr[i] * xr[i];
#else
        float ss = 0.f;
        for (int64_t i = 0; i < d; i++) ss += xr[i] * xr[i];
#endif
        const float r = 1.f / sqrtf(ss / (float)d + eps);
        for (int64_t i = 0; i < d; i++) y[m * d + i] = w[i] * (xr[i] * r);
    }
}

static void rms_norm(const float *x, const float *w, int64_t M, int64_t d, float eps, float *y) {
    if (M < SQ_ROWS_PARALLEL_MIN) {
        rms_norm_rows(x, w, 0, M, d, eps, y);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; m++) rms_norm_rows(x, w, m, m + 1, d, eps, y);
}

/* e^x, vectorized: x = n ln2 + r (|r| <= ln2 / 2), e^r by its Taylor polynomial to r^6 (truncation < 1e-7
 * relative), times 2^n. Within a few ulp of expf, and the same function for every element wherever it sits in a row,
 * so rows stay independent. Scalar expf cost ~0.7 ms a SmolLM2 decode step in SiLU alone (1536 a row and layer). */
#ifdef __AVX512F__
static inline __m512 vexp(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}


/* p[t] = e^(p[t] - sub), t < n */
static void exp_shifted(float *p, int64_t n, float sub) {
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 k = tail_mask(n - t);
        const __m512 v = _mm512_maskz_loadu_ps(k, p + t);
        _mm512_mask_storeu_ps(p + t, k, vexp(_mm512_sub_ps(v, _mm512_set1_ps(sub))));
    }
}

/* a[j] = silu(g[j]) * u[j] = g / (1 + e^-g) * u, j < n */
static void silu_mul(const float *g, const float *u, float *a, int64_t n) {
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = tail_mask(n - j);
        const __m512 gv = _mm512_maskz_loadu_ps(k, g + j);
        const __m512 e = vexp(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_mask_storeu_ps(a + j, k, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(k, u + j)));
    }
}
#elif defined(__AVX2__)
/* vexp on 8 lanes: the same steps, 2^n made in the exponent bits (exact, as scalef is, for the normal range: x is
 * clamped to 88.3 here, n <= 127, which changes nothing where it is used: softmax exponents <= 0, SiLU's e^-g at
 * g < -88 already rounds the product to 0) */
static inline __m256 vexp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3f)), _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static void exp_shifted(float *p, int64_t n, float sub) {
    int64_t t = 0;
    for (; t + 8 <= n; t += 8)
        _mm256_storeu_ps(p + t, vexp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), _mm256_set1_ps(sub))));
    if (t < n) { /* the tail through the same vector function, so every element gets the same exp */
        float tail[8] = {0};
        memcpy(tail, p + t, sizeof(float) * (n - t));
        _mm256_storeu_ps(tail, vexp8(_mm256_sub_ps(_mm256_loadu_ps(tail), _mm256_set1_ps(sub))));
        memcpy(p + t, tail, sizeof(float) * (n - t));
    }
}

static inline __m256 silu8(__m256 g, __m256 u) {
    const __m256 e = vexp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}

static void silu_mul(const float *g, const float *u, float *a, int64_t n) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(a + j, silu8(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
    if (j < n) {
        float gt[8] = {0}, ut[8] = {0};
        memcpy(gt, g + j, sizeof(float) * (n - j));
        memcpy(ut, u + j, sizeof(float) * (n - j));
        _mm256_storeu_ps(gt, silu8(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut)));
        memcpy(a + j, gt, sizeof(float) * (n - j));
    }
}
#else
static void exp_shifted(float *p, int64_t n, float sub) {
    for (int64_t t = 0; t < n; t++) p[t] = expf(p[t] - sub);
}

static void silu_mul(const float *g, const float *u, float *a, int64_t n) {
    for (int64_t j = 0; j < n; j++) a[j] = g[j] / (1.f + expf(-g[j])) * u[j];
}
#endif

#include "attention.c"

#ifdef __AVX2__
#ifdef __AVX512F__
/* one (chunk, key/value head) task of a decode step or a short pass over a KIVI cache: the group's query heads x
 * the rows, in batches of `kivi_batch`, each batch reading every position of the chunk once (`attend_kivi`) */
static void attend_group(const kivi_src *src, const float *wide, int64_t qkvn, int64_t kvh,
                         int64_t group, int64_t M, int64_t start, int64_t t0, int64_t hd, float scaling, float *parts,
                         int64_t chunks, int64_t c) {
    const int64_t stride = hd + 2;
    float kt[16 * 128], p[6 * SQ_KV_CHUNK];
    const float *qs[6];
    float *res[6];
    int64_t lens[6];
    int n = 0;
    for (int64_t h = kvh * group; h < (kvh + 1) * group; h++)
        for (int64_t m = 0; m < M; m++) {
            const int64_t len = start + m + 1 - t0;
            if (len <= 0) continue;
            qs[n] = wide + m * qkvn + h * hd;
            res[n] = parts + ((h * M + m) * chunks + c) * stride;
            lens[n++] = len < SQ_KV_CHUNK ? len : SQ_KV_CHUNK;
            if (n == kivi_batch(hd)) {
                attend_kivi(qs, lens, n, src, t0, hd, scaling, kt, p, res);
                n = 0;
            }
        }
    if (n) attend_kivi(qs, lens, n, src, t0, hd, scaling, kt, p, res);
}
#endif

/* the stack over a full-precision cache (kbuf, vbuf: each layer's [kv_heads][cap][head_dim] buffers, fp32 or fp16)
 * or, where kq != NULL, a KIVI cache (kv: each layer's `sq_kvq_layer`; cap unused): see sq_decoder_layers below */
static int stack(const sq_layer *layers, int64_t n_layers, const sq_dims *dm, float *hidden, int64_t M,
                 const float *cos, const float *sin, void *const *kbuf, void *const *vbuf, const sq_kvq_layer *kv,
                 const sq_kvq *kq, int64_t start) {
    const int64_t d = dm->d, H = dm->heads, KV = dm->kv_heads, hd = dm->head_dim, I = dm->inter, cap = dm->cap;
    const int64_t qn = H * hd, kvn = KV * hd, qkvn = qn + 2 * kvn, group = H / KV, end = start + M;
    const int half = !kq && dm->kv_half != 0, width_kv = half ? 2 : 4; /* bytes a cached element takes */
    if (M <= 0 || hd % 8 || H % KV || hd > 512 || (!kq && end > cap)) return 1;
    if (kq && (kq->vgroup % 8 || hd % kq->vgroup || (kq->bits != 2 && kq->bits != 4 && kq->bits != 8)
               || kq->new_at + M > kq->new_rows))
        return 1;
    const int64_t width = qkvn > 2 * I ? qkvn : 2 * I;
    float *xn = malloc(sizeof(float) * M * (d > I ? d : I));
    float *wide = malloc(sizeof(float) * M * width);
    float *att = malloc(sizeof(float) * M * qn);
    float *proj = malloc(sizeof(float) * M * d);
    const int64_t chunks = (end + SQ_KV_CHUNK - 1) / SQ_KV_CHUNK, stride = hd + 2;
    float *parts = malloc(sizeof(float) * H * M * chunks * stride); /* [H][M][chunks][hd + 2]: `attend`'s partials */
    /* per thread, a chunk's keys and values in fp32: widened from fp16 (head dims `attend_zmm` does not widen as it
     * loads), or read from a KIVI cache (`fill_chunk`) */
    const int tiled = kq || (half && !widens_as_loaded(hd));
    float *tiles = tiled ? malloc(sizeof(float) * omp_get_max_threads() * 2 * SQ_KV_CHUNK * hd) : NULL;
    int rc = (!xn || !wide || !att || !proj || !parts || (tiled && !tiles)) ? 3 : 0;
    double sq_last = sq_timing ? sq_now() : 0.;
    for (int64_t l = 0; l < n_layers && !rc; l++) {
        const sq_layer *L = layers + l;
        char *kc = kq ? NULL : kbuf[l], *vc = kq ? NULL : vbuf[l];
        rms_norm(hidden, L->in_norm, M, d, dm->eps, xn);
        SQ_MARK(0);
        if ((rc = q4(&L->qkv, xn, M, wide))) break;
        SQ_MARK(1);
        float tmp[512];
        for (int64_t m = 0; m < M; m++) {
            float *row = wide + m * qkvn;
            const float *c = cos + m * hd, *s = sin + m * hd;
            for (int64_t h = 0; h < H; h++) {
                rotate(row + h * hd, c, s, hd, tmp);
                memcpy(row + h * hd, tmp, sizeof(float) * hd);
            }
            for (int64_t h = 0; h < KV; h++) {
                if (kq) { /* the new rows in fp32: behind the window, or a scratch the Python side appends */
                    const int64_t at = (h * kq->new_rows + kq->new_at + m) * hd;
                    rotate(row + qn + h * hd, c, s, hd, kv[l].k_new + at);
                    memcpy(kv[l].v_new + at, row + qn + kvn + h * hd, sizeof(float) * hd);
                    continue;
                }
                const int64_t at = (h * cap + start + m) * hd * width_kv;
                if (half) {
                    rotate(row + qn + h * hd, c, s, hd, tmp);
                    to_half(tmp, (uint16_t *)(kc + at), hd);
                    to_half(row + qn + kvn + h * hd, (uint16_t *)(vc + at), hd);
                } else {
                    rotate(row + qn + h * hd, c, s, hd, (float *)(kc + at));
                    memcpy(vc + at, row + qn + kvn + h * hd, sizeof(float) * hd);
                }
            }
        }
        SQ_MARK(2);
        if (kq) {
            /* tasks (chunk, key/value head): the chunk read once into fp32 tiles, then every query head of the group
             * and every row over it */
#pragma omp parallel for schedule(static) if (H * M * end > SQ_ATTN_PARALLEL_MIN)
            for (int64_t ck = 0; ck < chunks * KV; ck++) { /* a head's chunks in a row: its codes are one stream */
                const int64_t c = ck % chunks, kvh = ck / chunks, t0 = c * SQ_KV_CHUNK;
                const int64_t t1 = t0 + SQ_KV_CHUNK < end ? t0 + SQ_KV_CHUNK : end;
                float *kt = tiles + (int64_t)omp_get_thread_num() * 2 * SQ_KV_CHUNK * hd, *vt = kt + SQ_KV_CHUNK * hd;
#ifdef __AVX512F__
                /* a decode step or a verify pass's piece (the cache cuts those at 8 rows): the queries in batches, each
                 * position read once a batch; a prompt's many rows: `fill_chunk` reads the chunk once for all, but
                 * where keys are scored in integers, which only `attend_kivi` does (a row's scores must not depend on
                 * how many rows the call holds) */
                if (kivi_in_registers(kq, hd) && (group * M <= SQ_KIVI_QUERIES || kivi_int_scores(kq))) {
                    const kivi_src src = kivi_head(kv + l, kq, kvh, start, hd);
                    attend_group(&src, wide, qkvn, kvh, group, M, start, t0, hd, dm->scaling, parts, chunks, c);
                    continue;
                }
#endif
                float p[SQ_KV_CHUNK];
                fill_chunk(kv + l, kq, kvh, t0, t1, start, hd, kt, vt);
                for (int64_t h = kvh * group; h < (kvh + 1) * group; h++)
                    for (int64_t m = 0; m < M; m++) {
                        const int64_t len = start + m + 1 - t0;
                        if (len <= 0) continue;
                        attend_head(wide + m * qkvn + h * hd, kt, vt, len < SQ_KV_CHUNK ? len : SQ_KV_CHUNK, hd,
                                    dm->scaling, p, parts + ((h * M + m) * chunks + c) * stride, 0, NULL);
                    }
            }
        } else {
        /* tasks (chunk, head), heads inner: the query heads sharing a key/value head (GQA) read its chunk back to
         * back, while it is in cache */
#pragma omp parallel for schedule(static) if (H * M * end > SQ_ATTN_PARALLEL_MIN)
            for (int64_t ch = 0; ch < chunks * H; ch++) {
                const int64_t c = ch / H, h = ch % H, kvh = h / group, t0 = c * SQ_KV_CHUNK;
                const char *kh = kc + (kvh * cap + t0) * hd * width_kv, *vh = vc + (kvh * cap + t0) * hd * width_kv;
                float p[SQ_KV_CHUNK];
                float *tile = tiles ? tiles + (int64_t)omp_get_thread_num() * 2 * SQ_KV_CHUNK * hd : NULL;
                for (int64_t m = 0; m < M; m++) {
                    const int64_t len = start + m + 1 - t0; /* this row's keys from t0 on */
                    if (len <= 0) continue;
                    attend_head(wide + m * qkvn + h * hd, kh, vh, len < SQ_KV_CHUNK ? len : SQ_KV_CHUNK, hd,
                                dm->scaling, p, parts + ((h * M + m) * chunks + c) * stride, half, tile);
                }
            }
        }
#pragma omp parallel for schedule(static) if (H * M * chunks * hd > SQ_ATTN_PARALLEL_MIN * 64)
        for (int64_t hm = 0; hm < H * M; hm++) {
            const int64_t h = hm / M, m = hm % M, n = (start + m + SQ_KV_CHUNK) / SQ_KV_CHUNK;
            combine(parts + hm * chunks * stride, n, hd, att + m * qn + h * hd);
        }
        SQ_MARK(3);
        if ((rc = q4(&L->o, att, M, proj))) break;
        SQ_MARK(1);
        add_rows(hidden, proj, M * d, M);
        rms_norm(hidden, L->post_norm, M, d, dm->eps, xn);
        SQ_MARK(0);
        if ((rc = q4(&L->gate_up, xn, M, wide))) break;
        SQ_MARK(1);
        if (M < SQ_ROWS_PARALLEL_MIN)
            for (int64_t m = 0; m < M; m++) silu_mul(wide + m * 2 * I, wide + m * 2 * I + I, xn + m * I, I);
        else
#pragma omp parallel for schedule(static)
            for (int64_t m = 0; m < M; m++) silu_mul(wide + m * 2 * I, wide + m * 2 * I + I, xn + m * I, I);
        SQ_MARK(4);
        if ((rc = q4(&L->down, xn, M, proj))) break;
        SQ_MARK(1);
        add_rows(hidden, proj, M * d, M);
        SQ_MARK(0);
    }
    free(xn);
    free(wide);
    free(att);
    free(proj);
    free(parts);
    free(tiles);
    return rc;
}
#endif

/* The stack over a full-precision cache: hidden [M, d] through every layer, the rows' keys and values written at
 * slots start .. start + M - 1 of kbuf / vbuf. 0, or 1 (shapes), 2 (built without AVX2), 3 (out of memory). */
int sq_decoder_layers(const sq_layer *layers, int64_t n_layers, const sq_dims *dm, float *hidden, int64_t M,
                      const float *cos, const float *sin, void *const *kbuf, void *const *vbuf, int64_t start) {
#ifndef __AVX2__
    return 2;
#else
    return stack(layers, n_layers, dm, hidden, M, cos, sin, kbuf, vbuf, NULL, NULL, start);
#endif
}

/* The stack over a KIVI cache of `start` tokens (`sq_kvq_layer`, one per layer): the rows' keys and values go to each
 * layer's k_new / v_new, not into the cache. The same return codes. */
int sq_decoder_layers_kvq(const sq_layer *layers, int64_t n_layers, const sq_dims *dm, float *hidden, int64_t M,
                          const float *cos, const float *sin, const void *kv, const void *kq, int64_t start) {
#ifndef __AVX2__
    return 2;
#else
    return stack(layers, n_layers, dm, hidden, M, cos, sin, NULL, NULL, (const sq_kvq_layer *)kv,
                 (const sq_kvq *)kq, start);
#endif
}

/* 1 where this build reads a KIVI cache's grouped codes in integers at int8 activations (`kivi_int_scores`) */
int sq_int_scores_built(void) {
#ifdef SQ_INT_SCORES
    return 1;
#else
    return 0;
#endif
}
