/* y[M,N] = x[M,K] @ W.T (+ bias) with W and x rounded to bf16, fp32 accumulation (AVX512-BF16: vdpbf16ps).
 *
 * Layout "b16" (documented in toolkit/quant/bf16_native.py, packed by bf16_native.pack): output channels in blocks
 * of 16, blocks in tiles of 4 (the last tile may hold fewer, nt), each tile stored in the order the kernel reads it:
 *   w  uint16 (bf16 bits), tile t at element t*4*16*K, ordered [K/2, nt, 16, 2]: element (p, b, j, e) =
 *   W[16(4t+b)+j, 2p+e]
 * so one 64-byte load is 16 output channels x 2 input columns, one vdpbf16ps operand.
 *
 * Why: half_gemm.c's fp16 x fp32 product runs at the fp32 FMA rate, which bounds a speculative verify pass of a few
 * rows on these cores; vdpbf16ps does two multiply-adds per lane and instruction. The price is the rounding: each
 * activation and weight is rounded to bf16 (8 significant bits) before the exact products are summed in fp32, the
 * arithmetic of a bf16 model (engine.native_dot=bf16). Rows are independent: each row's activations are rounded on
 * their own and a row's sums run in the same order whatever M or the tiling.
 *
 * Constraints (checked by the caller, returned as nonzero here): N % 16 == 0, K % 32 == 0. Without AVX512-BF16 the
 * function returns 2 and the caller keeps the fp16 kernel.
 */
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define B16_INLINE static inline __attribute__((always_inline))

/* tile t: its NB blocks of 16 outputs x R rows; xp holds each row's bf16 activations in pairs (one uint32 per pair) */
B16_INLINE void btile(const uint32_t *xp, int64_t K2, const uint16_t *w, const float *bias, float *y, int64_t N,
                      int64_t t, const int NB, const int R) {
    const uint16_t *wt = w + t * 4 * 32 * K2;
    const int64_t b0 = 4 * t;
    __m512 acc[6][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++) acc[r][j] = bias ? _mm512_loadu_ps(bias + (b0 + j) * 16) : _mm512_setzero_ps();
    for (int64_t p = 0; p < K2; p++) {
        const uint16_t *wp = wt + p * NB * 32;
        __m512bh xb[6]; /* each row's pair broadcast once per pair of columns, reused over the NB blocks */
        for (int r = 0; r < R; r++) xb[r] = (__m512bh)_mm512_set1_epi32((int)xp[r * K2 + p]);
        for (int j = 0; j < NB; j++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(wp + j * 32));
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, xb[r]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++) _mm512_storeu_ps(y + r * N + (b0 + j) * 16, acc[r][j]);
}

#define BTILE(NB, R) btile(xp + m * K2, K2, w, bias, y + m * N, N, i, NB, R)
/* up to 6 rows per pass over a tile, as half_gemm.c */
#define BROWS(NB)                                                \
    do {                                                         \
        int64_t m = 0;                                           \
        for (; m + 6 <= M; m += 6) BTILE(NB, 6);                 \
        switch (M - m) {                                         \
            case 5: BTILE(NB, 5); break;                         \
            case 4: BTILE(NB, 4); break;                         \
            case 3: BTILE(NB, 3); break;                         \
            case 2: BTILE(NB, 2); break;                         \
            case 1: BTILE(NB, 1); break;                         \
            default: break;                                      \
        }                                                        \
    } while (0)

int sq_b16_linear(const float *x, int64_t M, int64_t K, const uint16_t *w, const float *bias, int64_t N, float *y) {
    if (N % 16 || K % 32 || K <= 0 || M < 0) return 1;
    const int64_t K2 = K / 2, nblk = N / 16, ntile = (nblk + 3) / 4;
    uint32_t local[8192]; /* a decode step's or verify pass's rows: no allocation */
    uint32_t *xp = M * K2 <= 8192 ? local : malloc(sizeof(uint32_t) * (size_t)(M * K2));
    if (!xp) return 3;
    for (int64_t m = 0; m < M; m++) /* round to nearest even, 32 columns at a time, in column order */
        for (int64_t k = 0; k < K; k += 32)
            _mm512_storeu_si512((void *)(xp + m * K2 + k / 2),
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + m * K + k + 16),
                                                             _mm512_loadu_ps(x + m * K + k)));
#pragma omp parallel for schedule(static) if (ntile > 1 && M * N * K > 32768)
    for (int64_t i = 0; i < ntile; i++) {
        const int64_t nb = nblk - 4 * i < 4 ? nblk - 4 * i : 4;
        switch (nb) {
            case 4: BROWS(4); break;
            case 3: BROWS(3); break;
            case 2: BROWS(2); break;
            default: BROWS(1); break;
        }
    }
    if (xp != local) free(xp);
    return 0;
}
#else
int sq_b16_linear(const float *x, int64_t M, int64_t K, const uint16_t *w, const float *bias, int64_t N, float *y) {
    return 2;
}
#endif
