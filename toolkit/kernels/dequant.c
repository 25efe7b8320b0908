/* Fused dequantization of the quantized KV cache: unpack the codes, scale, add the minimum, rotate pre-RoPE keys
 * back, and write attention's float rows, in one pass over the cache.
 *
 * Why a kernel: in torch each of those is its own elementwise op (four masked shifts to unpack 2-bit codes, a
 * multiply, an add, five ops for the rotation on a strided 14-of-64 channel view), each a round trip through
 * memory: at 2048 tokens one layer's INT2 pre-RoPE keys took ~0.35-0.5 ms, ~0.12 ms here. Every element is read
 * once and written once.
 *
 * Arithmetic is exactly the torch path's (toolkit/kv/quantized_cache.py; built with -ffp-contract=off so the
 * compiler fuses no multiply-add on its own): x = code * scale, then x + min, in fp32; the rotation
 * a' = fma(-b, sin, a cos) (torch's addcmul_ is one fused multiply-add), b' = b cos + a sin. bf16 output rounds to
 * nearest even, as torch's conversion does. tests/test_kv_kernel.py checks the two paths are bit-equal.
 *
 * AVX2 where the compiler targets it (8 codes per step: their bytes broadcast, shifted per lane, masked, converted);
 * plain C otherwise. OpenMP splits the tokens over the cores.
 *
 * Layouts (row = one (batch, head); strides in elements):
 *   codes   uint8, [rows][tokens][D * bits / 8], lowest bits first (toolkit/kv/quantize.py `pack`)
 *   keys:   scale/min fp32 [rows][tokens / G][D]         (per channel over G tokens)
 *   values: scale/min fp32 [rows][tokens][D / vg]        (per token over vg channels)
 *   out     fp32 or bf16, [rows][tokens][D] with the given row stride (a view of the attention workspace)
 *   cos/sin fp32 [tokens][pairs], already offset to the first token's position; pair i rotates channels
 *           (i, i + D / 2).
 */
#include <stdint.h>
#include <math.h>
#include <string.h>

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1); /* round to nearest even (finite inputs: codes, scales and minima are finite) */
    return (uint16_t)(u >> 16);
}

#ifdef __AVX2__
#include <immintrin.h>

/* 8 codes at code index j (a multiple of 8) as floats: the bytes holding them broadcast to every lane, each lane
 * shifted by its own amount and masked (2 bytes at 2 bits, 4 at 4 bits, pmovzx at 8). */
static inline __m256 codes8(const uint8_t *c, int j, int bits) {
    if (bits == 8) return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + j))));
    uint32_t w;
    __m256i shift, mask;
    if (bits == 4) {
        memcpy(&w, c + j / 2, 4);
        shift = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        mask = _mm256_set1_epi32(15);
    } else {
        uint16_t h;
        memcpy(&h, c + j / 4, 2);
        w = h;
        shift = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
        mask = _mm256_set1_epi32(3);
    }
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), shift), mask));
}
#endif

/* One token's codes -> D floats in `row`, times scale plus minimum: per channel (s, m: D values, keys) or per
 * `group` channels (s, m: D / group values, values). x * s then + m, two roundings, as torch's mul_ then add_. */
static inline void unpack_scale(const uint8_t *restrict c, int D, int bits, int per_channel, int group,
                                const float *restrict s, const float *restrict m, float *restrict row) {
#ifdef __AVX2__
    if (D % 8 == 0 && (per_channel || group % 8 == 0)) {
        for (int j = 0; j < D; j += 8) {
            __m256 sv = per_channel ? _mm256_loadu_ps(s + j) : _mm256_set1_ps(s[j / group]);
            __m256 mv = per_channel ? _mm256_loadu_ps(m + j) : _mm256_set1_ps(m[j / group]);
            _mm256_storeu_ps(row + j, _mm256_add_ps(_mm256_mul_ps(codes8(c, j, bits), sv), mv));
        }
        return;
    }
#endif
    const int mask = (1 << bits) - 1, per = 8 / bits;
    for (int j = 0; j < D; j++) {
        float x = (float)((c[j / per] >> ((j % per) * bits)) & mask) * (per_channel ? s[j] : s[j / group]);
        row[j] = x + (per_channel ? m[j] : m[j / group]);
    }
}

/* One token: unpack, scale and shift (s, m: this token's D per-channel values for keys, or D / group per-token
 * values for values), rotate pairs back for pre-RoPE keys (c, sn: this token's cos/sin, or pairs == 0). */
static inline void token(int kind, const uint8_t *restrict code, const float *restrict s, const float *restrict m,
                         const float *restrict c, const float *restrict sn, int pairs, char *o, int bf16, int D,
                         int bits, int group) {
    float buf[512];
    float *restrict row = bf16 ? buf : (float *)o;
    unpack_scale(code, D, bits, kind == 0, group, s, m, row);
    if (kind == 0) {
        const int half = D / 2;
        for (int i = 0; i < pairs; i++) {
            float a = row[i], b = row[i + half];
            float bc = b * c[i], as = a * sn[i];
            row[i] = fmaf(-b, sn[i], a * c[i]); /* torch's addcmul_ is one fused multiply-add */
            row[i + half] = bc + as;
        }
    }
    if (bf16) {
        uint16_t *ob = (uint16_t *)o;
        for (int j = 0; j < D; j++) ob[j] = to_bf16(row[j]);
    }
}

#define CHUNK 64 /* tokens per unit of work; keys: a multiple of it or of the group lies in one group */

/* kind 0: keys (scale per G tokens and channel), kind 1: values (scale per token and vg channels). slot, kidx: see
 * `sq_dequant`. */
static void dequant(int kind, const uint8_t *codes, int64_t code_row_stride, const float *scale, const float *mn,
                    int64_t scale_row_stride, void *out, int64_t out_row_stride, int bf16, int rows, int tokens,
                    int D, int bits, int group, const float *cos, const float *sin, int pairs, const int64_t *slot,
                    const int64_t *kidx) {
    const int nb = D * bits / 8;
    const int64_t esize = bf16 ? 2 : 4;
    const int chunk = kind == 0 && !kidx && group < CHUNK ? group : CHUNK, per_row = (tokens + chunk - 1) / chunk;
    /* two threads where the output is large: one core does not keep up; no division per token (slow on 64 bits) */
#pragma omp parallel for schedule(static) if ((int64_t)rows * tokens * D > 32768)
    for (int64_t w = 0; w < (int64_t)rows * per_row; w++) {
        const int64_t r = w / per_row;
        const int t0 = (int)(w % per_row) * chunk, t1 = t0 + chunk < tokens ? t0 + chunk : tokens;
        const uint8_t *cr = codes + r * code_row_stride;
        const float *sr = scale + r * scale_row_stride, *mr = mn + r * scale_row_stride;
        char *orow = (char *)out + r * out_row_stride * esize;
        const int64_t g = kind == 0 ? (int64_t)(t0 / group) * D : 0;
        const int per = D / group;
        for (int t = t0; t < t1; t++) {
            const int64_t ks = kidx ? kidx[t] * D : g, at = slot ? slot[t] : t;
            const float *s = kind == 0 ? sr + ks : sr + (int64_t)t * per;
            const float *m = kind == 0 ? mr + ks : mr + (int64_t)t * per;
            token(kind, cr + at * nb, s, m, pairs ? cos + (int64_t)t * pairs : 0,
                  pairs ? sin + (int64_t)t * pairs : 0, pairs, orow + (int64_t)t * D * esize, bf16, D, bits, group);
        }
    }
}

/* The one entry point. Contiguous reads (the engine's cache): slot = kidx = NULL, the keys' scales per `group`
 * tokens. Gathers (the paged cache): token t's codes at slot[t]; a key's scales at row kidx[t] (its block among the
 * distinct blocks read), values' scales gathered per token beforehand. cos/sin: pre-RoPE keys only, else NULL. */
int sq_dequant(int kind, const uint8_t *codes, int64_t code_row_stride, const int64_t *slot, const int64_t *kidx,
               const float *scale, const float *mn, int64_t scale_row_stride, void *out, int64_t out_row_stride,
               int bf16, int rows, int tokens, int D, int bits, int group, const float *cos, const float *sin,
               int pairs) {
    if (D > 512 || group <= 0 || (kind == 1 && D % group) || (kind == 0 && !kidx && tokens % group)) return -1;
    dequant(kind, codes, code_row_stride, scale, mn, scale_row_stride, out, out_row_stride, bf16, rows, tokens, D,
            bits, group, cos, sin, cos ? pairs : 0, slot, kidx);
    return 0;
}
