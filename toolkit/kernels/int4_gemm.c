/* y[M,N] = x[M,K] @ W.T (+ bias) for a 4-bit group-quantized W, fp32 activations and accumulation (AVX2 + FMA).
 *
 * Layout "n8" (documented in toolkit/quant/int4_native.py, packed by int4_native.pack):
 *   codes  uint8 [N/8, K/2, 8]: byte (b, p, j) = q[8b+j, 2p] | q[8b+j, 2p+1] << 4, codes 0..15
 *   scale  float [N/8, ceil(K/G), 8], zero uint8 [N/8, ceil(K/G), 8]: w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g]
 * so a block of 8 output channels is one 256-bit lane set, and one 8-byte load feeds two input columns.
 *
 * Per group g and row m: y[m, n] += scale[n, g] * (sum_k q[n, k] x[m, k] - zero[n, g] * sum_k x[m, k]), the sums
 * over the group's columns; the integer codes become exact floats (0..15) and all arithmetic is fp32 FMA, so the
 * result is the dequantized weight's product up to fp32 rounding order (no activation quantization, unlike
 * llama.cpp's q4_0 x q8_0 dot products). Rows are independent: a row's result does not depend on M or on the rows
 * beside it (the same operations in the same order whatever the tiling), which speculative verification relies on.
 *
 * Constraints (checked by the caller, returned as nonzero here): N % 8 == 0, K even, G even; the last group may be
 * short (K % G != 0). Without AVX2 the function returns 2 and the caller keeps torch's kernel.
 */
#include <stdint.h>
#include <stdlib.h>

#include "tiles.h"
#ifdef __AVX2__
#include <immintrin.h>

/* NB blocks of 8 outputs (b0 .. b0+NB-1) x R rows starting at x; all loops have constant bounds after inlining */
SQ_INLINE void tile(const float *x, int64_t K, const float *xsum, int64_t ng, const uint8_t *codes, const float *sc,
                    const uint8_t *zp, int64_t G, const float *bias, float *y, int64_t N, int64_t b0, const int NB,
                    const int R) {
    const __m256i mask = _mm256_set1_epi32(0xF);
    const int64_t half = K / 2;
    __m256 yv[4][4];  /* [rows][blocks], R <= 4, NB <= 4 */
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++) yv[r][j] = bias ? _mm256_loadu_ps(bias + (b0 + j) * 8) : _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m256 alo[4][4], ahi[4][4];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < NB; j++) alo[r][j] = ahi[r][j] = _mm256_setzero_ps();
        const int64_t p0 = g * G / 2, p1 = p0 + G / 2 < half ? p0 + G / 2 : half;
        const uint8_t *cb = codes + (b0 * half + p0) * 8;
        for (int64_t p = p0; p < p1; p++, cb += 8) {
            __m256 x0[4], x1[4];
            for (int r = 0; r < R; r++) {
                x0[r] = _mm256_broadcast_ss(x + r * K + 2 * p);
                x1[r] = _mm256_broadcast_ss(x + r * K + 2 * p + 1);
            }
            for (int j = 0; j < NB; j++) {
                __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(cb + j * half * 8)));
                __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
                __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
                for (int r = 0; r < R; r++) {
                    alo[r][j] = _mm256_fmadd_ps(lo, x0[r], alo[r][j]);
                    ahi[r][j] = _mm256_fmadd_ps(hi, x1[r], ahi[r][j]);
                }
            }
        }
        for (int j = 0; j < NB; j++) {
            __m256 s = _mm256_loadu_ps(sc + ((b0 + j) * ng + g) * 8);
            __m256 z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(zp + ((b0 + j) * ng + g) * 8))));
            for (int r = 0; r < R; r++) {
                __m256 a = _mm256_add_ps(alo[r][j], ahi[r][j]);
                yv[r][j] = _mm256_fmadd_ps(s, _mm256_fnmadd_ps(z, _mm256_broadcast_ss(xsum + r * ng + g), a), yv[r][j]);
            }
        }
    }
    for (int j = 0; j < NB; j++)
        for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * N + (b0 + j) * 8, yv[r][j]);
}

/* 4-row tiles need 24 accumulators + 8 broadcasts: AVX512's 32 vector registers hold them, AVX2's 16 would spill */
#ifdef __AVX512F__
#define WIDE_ROWS 1
#else
#define WIDE_ROWS 0
#endif
#define TILE(NB, R) tile(x + m * K, K, xsum + m * ng, ng, codes, scale, zero, G, bias, y + m * N, N, b0, NB, R)
#define ROWS(NB)                                                 \
    do {                                                         \
        int64_t m = 0;                                           \
        if (NB <= 2 && WIDE_ROWS)                                \
            for (; m + 4 <= M; m += 4) TILE(NB, 4);              \
        if (NB <= 2)                                             \
            for (; m + 2 <= M; m += 2) TILE(NB, 2);              \
        for (; m < M; m++) TILE(NB, 1);                          \
    } while (0)

int sq_int4_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scale,
                   const uint8_t *zero, const float *bias, int64_t N, int64_t G, float *y) {
    if (N % 8 || K % 2 || G % 2 || G <= 0 || M < 0) return 1;
    const int64_t ng = (K + G - 1) / G, nblk = N / 8;
    float *xsum = malloc(sizeof(float) * (M * ng + 1));
    if (!xsum) return 3;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ng; g++) {
            float s = 0.f;
            for (int64_t k = g * G; k < (g + 1) * G && k < K; k++) s += x[m * K + k];
            xsum[m * ng + g] = s;
        }
    /* one row: 4 blocks (32 outputs) per tile, lo/hi accumulators 8 chains; more rows: 2 blocks x 4 rows, then x 2,
     * then x 1 (4 rows share each code's unpacking: 15-17% faster than 2 at 4-256 rows, 1536x576 here; AVX512
     * builds only, see WIDE_ROWS) */
    const int64_t nbw = M == 1 ? 4 : 2, ntile = (nblk + nbw - 1) / nbw;
    SQ_FOR_EACH_TILE(i, ntile, M * N * K) {
        const int64_t b0 = i * nbw, nb = SQ_TILE_BLOCKS(nblk, i, nbw);
        SQ_BY_BLOCKS(nb, ROWS)
    }
    free(xsum);
    return 0;
}

/* The float weight of blocks b0..b1-1 as rows [(b1-b0)*8, K]: w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], the
 * difference exact in fp32 and one rounding for the product (what the dequantize path computes in torch, bit for
 * bit). out_bf16 != 0: written as bf16 (round to nearest even, as torch's cast) into a uint16 buffer, else fp32.
 * One pass, rows written in order: the prompt's dequantize path, several times faster than torch's four passes. */
int sq_int4_dequant(const uint8_t *codes, const float *scale, const uint8_t *zero, int64_t N, int64_t K, int64_t G,
                    int64_t b0, int64_t b1, void *out, int out_bf16) {
    if (N % 8 || K % 2 || G % 2 || G <= 0 || b0 < 0 || b1 > N / 8 || b0 > b1) return 1;
    const int64_t ng = (K + G - 1) / G, half = K / 2, rows = (b1 - b0) * 8;
#pragma omp parallel for schedule(static) if (rows * K > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t b = b0 + r / 8, j = r % 8;
        const uint8_t *cb = codes + b * half * 8 + j;
        float *rf = out_bf16 ? NULL : (float *)out + r * K;
        uint16_t *rb = out_bf16 ? (uint16_t *)out + r * K : NULL;
        for (int64_t g = 0; g < ng; g++) {
            const float s = scale[(b * ng + g) * 8 + j];
            const int z = zero[(b * ng + g) * 8 + j];
            const int64_t p0 = g * G / 2, p1 = p0 + G / 2 < half ? p0 + G / 2 : half;
            for (int64_t p = p0; p < p1; p++) {
                const uint8_t byte = cb[p * 8];
                const float w0 = (float)((byte & 15) - z) * s, w1 = (float)((byte >> 4) - z) * s;
                if (rf) {
                    rf[2 * p] = w0;
                    rf[2 * p + 1] = w1;
                } else {
                    union { float f; uint32_t u; } a = {w0}, c = {w1};
                    rb[2 * p] = (uint16_t)((a.u + 0x7FFF + ((a.u >> 16) & 1)) >> 16);
                    rb[2 * p + 1] = (uint16_t)((c.u + 0x7FFF + ((c.u >> 16) & 1)) >> 16);
                }
            }
        }
    }
    return 0;
}
#else
int sq_int4_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scale,
                   const uint8_t *zero, const float *bias, int64_t N, int64_t G, float *y) {
    return 2;
}
int sq_int4_dequant(const uint8_t *codes, const float *scale, const uint8_t *zero, int64_t N, int64_t K, int64_t G,
                    int64_t b0, int64_t b1, void *out, int out_bf16) {
    return 2;
}
#endif
