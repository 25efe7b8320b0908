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
 *
 * AMX (sq_b16_amx(1), where the CPU has AMX-BF16 and the kernel grants the tile state): the same products on the
 * tile unit. The b16 layout is already AMX's B operand: 16 consecutive input pairs of a block of 16 outputs are 16
 * rows of 64 bytes, nt * 64 bytes apart, one tileloadd; the rounded activations are the A operand as they stand.
 * One tdpbf16ps multiplies up to 16 rows by 16 x 32 weights, so a verify pass of 2-16 rows costs about one row's
 * time, where vdpbf16ps pays per row. The sums run over the input pairs in the same order, but the tile unit rounds
 * a pair's products its own way and the bias is added after the sums (vdpbf16ps: before), so its results may differ
 * from vdpbf16ps's in the last bits: once on, every call takes the tile path, whatever M, so rows stay independent
 * and decode steps and verify passes agree.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tiles.h"
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

/* tile t: its NB blocks of 16 outputs x R rows; xp holds each row's bf16 activations in pairs (one uint32 per pair) */
SQ_INLINE void btile(const uint32_t *xp, int64_t K2, const uint16_t *w, const float *bias, float *y, int64_t N,
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
#define BROWS(NB) SQ_ROW_PASSES(M, 6, BTILE, NB)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define B16_HAVE_AMX 1
static int b16_amx_on = 0; /* set by sq_b16_amx before any product; read-only while products run */

typedef struct { /* ldtilecfg's 64-byte operand, palette 1 */
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) b16_tilecfg;

/* tiles 0-3: the sums of up to 4 blocks (R rows x 16 fp32); 4: activations (R rows x 32 bf16); 5, 6: weights */
SQ_INLINE void amx_config(int R) {
    b16_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 5; i++) c.rows[i] = (uint8_t)R, c.colsb[i] = 64;
    for (int i = 5; i < 7; i++) c.rows[i] = 16, c.colsb[i] = 64;
    _tile_loadconfig(&c);
}

#define AMX_BLOCK(J, T)                                                                   \
    if (NB > J) {                                                                        \
        _tile_loadd(T, wt + (p * NB + J) * 32, NB * 64);                                 \
        _tile_dpbf16ps(J, 4, T);                                                         \
    }
#define AMX_STORE(J)                                                                       \
    if (NB > J) _tile_stored(J, out + J * 16, 4 * 64);

/* tile t (NB blocks of 16 outputs) for rows m0..m0+R of the rounded activations xp */
static void amx_tile(const uint32_t *xp, int64_t K2, const uint16_t *w, const float *bias, float *y, int64_t N,
                     int64_t t, int NB, int64_t m0, int R) {
    const uint16_t *wt = w + t * 4 * 32 * K2;
    float out[16 * 64];
    amx_config(R);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t p = 0; p < K2; p += 16) {
        _tile_loadd(4, xp + m0 * K2 + p, K2 * 4);
        AMX_BLOCK(0, 5) AMX_BLOCK(1, 6) AMX_BLOCK(2, 5) AMX_BLOCK(3, 6)
    }
    AMX_STORE(0) AMX_STORE(1) AMX_STORE(2) AMX_STORE(3)
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB * 16; j++)
            y[(m0 + r) * N + 4 * t * 16 + j] = bias ? out[r * 64 + j] + bias[4 * t * 16 + j] : out[r * 64 + j];
}
#endif

/* want 1: products on the tile unit from now on, if the CPU and the operating system allow it (Linux grants the
 * tile state to a process that asks, arch_prctl ARCH_REQ_XCOMP_PERM); 0: vdpbf16ps; -1: no change. Returns the state
 * now in force. Call before any product runs, never while one does. */
int sq_b16_amx(int want) {
#ifdef B16_HAVE_AMX
    if (want < 0) return b16_amx_on;
    if (want && !b16_amx_on && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0)
        return 0;
    b16_amx_on = want ? 1 : 0;
    return b16_amx_on;
#else
    (void)want;
    return 0;
#endif
}

int sq_b16_linear(const float *x, int64_t M, int64_t K, const uint16_t *w, const float *bias, int64_t N, float *y) {
    if (N % 16 || K % 32 || K <= 0 || M < 0) return 1;
    const int64_t K2 = K / 2, nblk = N / 16;
    uint32_t local[8192]; /* a decode step's or verify pass's rows: no allocation */
    uint32_t *xp = M * K2 <= 8192 ? local : malloc(sizeof(uint32_t) * (size_t)(M * K2));
    if (!xp) return 3;
    for (int64_t m = 0; m < M; m++) /* round to nearest even, 32 columns at a time, in column order */
        for (int64_t k = 0; k < K; k += 32)
            _mm512_storeu_si512((void *)(xp + m * K2 + k / 2),
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + m * K + k + 16),
                                                             _mm512_loadu_ps(x + m * K + k)));
#ifdef B16_HAVE_AMX
    if (b16_amx_on) {
        const int64_t ntile = (nblk + 3) / 4;
#pragma omp parallel if (ntile > 1 && M * N * K > 32768)
        {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < ntile; i++) {
                const int nb = (int)SQ_TILE_BLOCKS(nblk, i, 4);
                for (int64_t m = 0; m < M; m += 16) amx_tile(xp, K2, w, bias, y, N, i, nb, m, M - m < 16 ? (int)(M - m) : 16);
            }
            _tile_release();
        }
        if (xp != local) free(xp);
        return 0;
    }
#endif
    SQ_TILES_OF_4(nblk, M * N * K, BROWS);
    if (xp != local) free(xp);
    return 0;
}
#else
int sq_b16_amx(int want) {
    (void)want;
    return 0;
}
int sq_b16_linear(const float *x, int64_t M, int64_t K, const uint16_t *w, const float *bias, int64_t N, float *y) {
    return 2;
}
#endif
