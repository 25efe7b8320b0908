/* y[M,N] = x[M,K] @ W.T (+ bias) for an fp16 W, fp32 activations and accumulation (AVX512F, or AVX2 + F16C:
 * vcvtph2ps + FMA).
 *
 * Layout "h16" (documented in toolkit/quant/half_native.py, packed by half_native.pack): output channels in blocks
 * of 16, blocks in tiles of 4 (the last tile may hold fewer, nt), each tile stored in the order the kernel reads it:
 *   w  uint16 (fp16 bits), tile t at element t*4*16*K, ordered [K, nt, 16]: element (k, b, j) = W[16(4t+b)+j, k]
 * so one 32-byte load is 16 output channels of one input column, and a thread's tiles are one sequential stream.
 *
 * The product is the fp16 weight's exact value times the fp32 activation, summed in fp32 by explicit FMAs in input
 * order: the same model as fbgemm's fp16 GEMM (fp16 weights, fp32 activations), summed in another order. Rows are
 * independent: a row's sums run in the same order whatever M or the tiling, so a row's result does not depend on
 * the rows beside it -- what speculative verification needs from a target.
 *
 * Constraints (checked by the caller, returned as nonzero here): N % 16 == 0. Builds for AVX512F or AVX2 + F16C +
 * FMA; without either the function returns 2 and the caller keeps fbgemm.
 */
#include <stdint.h>
#include <stdlib.h>

#include "tiles.h"
#if defined(__AVX512F__)
#include <immintrin.h>

/* tile t: its NB blocks of 16 outputs x R rows; constant loop bounds after inlining */
SQ_INLINE void htile(const float *x, int64_t K, const uint16_t *w, const float *bias, float *y, int64_t N,
                     int64_t t, const int NB, const int R) {
    const uint16_t *wt = w + t * 4 * 16 * K;
    const int64_t b0 = 4 * t;
    __m512 acc[6][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++) acc[r][j] = bias ? _mm512_loadu_ps(bias + (b0 + j) * 16) : _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const uint16_t *wk = wt + k * NB * 16;
        __m512 xb[6]; /* each row's activation broadcast once per column, reused over the NB blocks */
        for (int r = 0; r < R; r++) xb[r] = _mm512_set1_ps(x[r * K + k]);
        for (int j = 0; j < NB; j++) {
            const __m512 wv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wk + j * 16)));
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_fmadd_ps(wv, xb[r], acc[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++) _mm512_storeu_ps(y + r * N + (b0 + j) * 16, acc[r][j]);
}

#define HTILE(NB, R) htile(x + m * K, K, w, bias, y + m * N, N, i, NB, R)
/* up to 6 rows per pass over a tile: a pass costs about the same with 1 row as with 6 (each weight is loaded and
 * widened once per pass), so a verify pass of 5 rows reads its weights once, not twice */
#define HROWS(NB) SQ_ROW_PASSES(M, 6, HTILE, NB)

int sq_f16_linear(const float *x, int64_t M, int64_t K, const uint16_t *w, const float *bias, int64_t N, float *y) {
    if (N % 16 || K <= 0 || M < 0) return 1;
    const int64_t nblk = N / 16;
    SQ_TILES_OF_4(nblk, M * N * K, HROWS);
    return 0;
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>

/* AVX2 + F16C: a block of 16 outputs is two 8-lane registers, 16 registers in all. One row takes a whole tile (8
 * accumulators); several rows take the tile two blocks at a time, up to 3 rows a pass (12 accumulators, 3
 * broadcasts, 1 weight). Each output's sum is the same chain as the AVX512 build's -- bias (or 0), then one FMA per
 * input column in order -- so the two builds agree bit for bit and rows stay independent. */
SQ_INLINE void htile2(const float *x, int64_t K, const uint16_t *w, const float *bias, float *y, int64_t N,
                      int64_t t, int64_t nb, int64_t j0, const int NJ, const int R) {
    const uint16_t *wt = w + t * 4 * 16 * K + j0 * 16;
    const int64_t c0 = (4 * t + j0) * 16;
    __m256 acc[3][8];
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2 * NJ; h++) acc[r][h] = bias ? _mm256_loadu_ps(bias + c0 + h * 8) : _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const uint16_t *wk = wt + k * nb * 16;
        __m256 xb[3];
        for (int r = 0; r < R; r++) xb[r] = _mm256_set1_ps(x[r * K + k]);
        for (int h = 0; h < 2 * NJ; h++) {
            const __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wk + h * 8)));
            for (int r = 0; r < R; r++) acc[r][h] = _mm256_fmadd_ps(wv, xb[r], acc[r][h]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2 * NJ; h++) _mm256_storeu_ps(y + r * N + c0 + h * 8, acc[r][h]);
}

#define HTILE2(NJ, R) htile2(x + m * K, K, w, bias, y + m * N, N, i, nb, j0, NJ, R)
#define HTILE2_ROW(NB) HTILE2(NB, 1)

int sq_f16_linear(const float *x, int64_t M, int64_t K, const uint16_t *w, const float *bias, int64_t N, float *y) {
    if (N % 16 || K <= 0 || M < 0) return 1;
    const int64_t nblk = N / 16, ntile = (nblk + 3) / 4;
    SQ_FOR_EACH_TILE(i, ntile, M * N * K) {
        const int64_t nb = SQ_TILE_BLOCKS(nblk, i, 4);
        int64_t m = 0, j0 = 0;
        if (M == 1) {
            SQ_BY_BLOCKS(nb, HTILE2_ROW)
            continue;
        }
        for (j0 = 0; j0 < nb; j0 += 2) {
            const int64_t nj = nb - j0 < 2 ? nb - j0 : 2;
            for (m = 0; m + 3 <= M; m += 3) {
                if (nj == 2) HTILE2(2, 3); else HTILE2(1, 3);
            }
            if (M - m == 2) {
                if (nj == 2) HTILE2(2, 2); else HTILE2(1, 2);
            } else if (M - m == 1) {
                if (nj == 2) HTILE2(2, 1); else HTILE2(1, 1);
            }
        }
    }
    return 0;
}
#else
int sq_f16_linear(const float *x, int64_t M, int64_t K, const uint16_t *w, const float *bias, int64_t N, float *y) {
    return 2;
}
#endif
