/* y[M,N] = x[M,K] @ (w * scale[:, None]).T (+ bias) for a symmetric per-channel int8 weight, fp32 activations and
 * accumulation (AVX512F, or AVX2 + FMA).
 *
 * Layout: the h16 order of toolkit/quant/half_native.py with int8 codes instead of fp16 (packed by int8_native.pack):
 * output channels in blocks of 16, blocks in tiles of 4 (the last tile may hold fewer, nt), each tile stored in the
 * order the kernel reads it:
 *   w  int8, tile t at element t*4*16*K, ordered [K, nt, 16]: element (k, b, j) = W[16(4t+b)+j, k]
 *   scale float [N], bias float [N] or NULL
 * so one 16-byte load is 16 output channels of one input column: the activation is broadcast, the codes widen to
 * fp32 once per column and serve every row of the pass, and no horizontal sum is needed (the layout of [N, K] rows
 * spent two widenings and a share of a horizontal sum per 8 products, and ran at half the speed).
 *
 * Each output is sum_k (code * x) in k order by explicit FMAs, then times the channel's scale, then plus its bias
 * (separate roundings; -ffp-contract=off). Every row is computed by the same operations in the same order whatever
 * M, the tiling or the instruction set (AVX512 and AVX2 builds agree bit for bit), so a row's result does not
 * depend on the rows beside it: what speculative verification needs from a target.
 *
 * Constraints (returned as nonzero): N % 16 == 0. Without AVX2 the function returns 2.
 */
#include <stdint.h>

#include "tiles.h"
#if defined(__AVX2__)
#include <immintrin.h>

#if defined(__AVX512F__)
/* tile t: its NB blocks of 16 outputs x R rows; constant loop bounds after inlining */
SQ_INLINE void i8_tile(const float *x, int64_t K, const int8_t *w, const float *scale, const float *bias, float *y,
                      int64_t N, int64_t t, const int NB, const int R) {
    const int8_t *wt = w + t * 4 * 16 * K;
    const int64_t c0 = 4 * t * 16;
    __m512 acc[6][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const int8_t *wk = wt + k * NB * 16;
        __m512 xb[6]; /* each row's activation broadcast once per column, reused over the NB blocks */
        for (int r = 0; r < R; r++) xb[r] = _mm512_set1_ps(x[r * K + k]);
        for (int j = 0; j < NB; j++) {
            const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wk + j * 16))));
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_fmadd_ps(wv, xb[r], acc[r][j]);
        }
    }
    for (int j = 0; j < NB; j++) {
        const __m512 s = _mm512_loadu_ps(scale + c0 + j * 16);
        const __m512 b = bias ? _mm512_loadu_ps(bias + c0 + j * 16) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++)
            _mm512_storeu_ps(y + r * N + c0 + j * 16, _mm512_add_ps(_mm512_mul_ps(acc[r][j], s), b));
    }
}
#define I8_MAX_ROWS 6 /* 6 rows x 4 blocks = 24 accumulators of the 32 registers */
#else
/* AVX2: a block of 16 outputs is two registers, so a tile of 4 blocks takes 8 accumulators a row: one row a pass */
SQ_INLINE void i8_tile(const float *x, int64_t K, const int8_t *w, const float *scale, const float *bias, float *y,
                      int64_t N, int64_t t, const int NB, const int R) {
    const int8_t *wt = w + t * 4 * 16 * K;
    const int64_t c0 = 4 * t * 16;
    (void)R;
    __m256 acc[8];
    for (int j = 0; j < 2 * NB; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const int8_t *wk = wt + k * NB * 16;
        const __m256 xb = _mm256_set1_ps(x[k]);
        for (int j = 0; j < 2 * NB; j++) {
            const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wk + j * 8))));
            acc[j] = _mm256_fmadd_ps(wv, xb, acc[j]);
        }
    }
    for (int j = 0; j < 2 * NB; j++) {
        const __m256 s = _mm256_loadu_ps(scale + c0 + j * 8);
        const __m256 b = bias ? _mm256_loadu_ps(bias + c0 + j * 8) : _mm256_setzero_ps();
        _mm256_storeu_ps(y + c0 + j * 8, _mm256_add_ps(_mm256_mul_ps(acc[j], s), b));
    }
}
#define I8_MAX_ROWS 1
#endif

#define I8_TILE(NB, R) i8_tile(x + m * K, K, w, scale, bias, y + m * N, N, i, NB, R)
/* up to I8_MAX_ROWS rows per pass over a tile (its codes widened once for all of them); fewer take a smaller pass */
#define I8_ROWS(NB) SQ_ROW_PASSES(M, I8_MAX_ROWS, I8_TILE, NB)

int sq_int8_linear(const float *x, int64_t M, int64_t K, const int8_t *w, const float *scale, const float *bias,
                   int64_t N, float *y) {
    if (N % 16 || K <= 0 || M < 0) return 1;
    const int64_t nblk = N / 16;
    SQ_TILES_OF_4(nblk, M * N * K, I8_ROWS);
    return 0;
}
#else
int sq_int8_linear(const float *x, int64_t M, int64_t K, const int8_t *w, const float *scale, const float *bias,
                   int64_t N, float *y) {
    return 2;
}
#endif
