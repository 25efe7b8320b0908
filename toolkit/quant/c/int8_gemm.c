/* y[M,N] = x[M,K] @ (w * scale[:, None]).T (+ bias) for a symmetric per-channel int8 weight, fp32 activations and
 * accumulation (AVX2 + FMA).
 *
 * Layout: torch's own for `_weight_int8pack_mm`, so QuantLinear's int8 layers need no second copy:
 *   w  int8 [N, K] row-major (codes q - 128 of GPTQ's unsigned convention), scale float [N]
 *
 * Tiles of 4 output channels x up to 2 rows: each (row, channel) accumulates 8 lanes along k in k order, then one
 * horizontal sum in a fixed order, times the channel's scale. Every row is computed by the same operations in the same
 * order whatever M or the tiling, so a row's result does not depend on the rows beside it.
 *
 * Constraints (returned as nonzero): K % 8 == 0. Without AVX2 the function returns 2.
 */
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>

#define I8_INLINE static inline __attribute__((always_inline))

I8_INLINE float i8_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* channels n0 .. n0+NC-1 x R rows starting at x */
I8_INLINE void i8_tile(const float *x, int64_t K, const int8_t *w, const float *scale, const float *bias, float *y,
                 int64_t N, int64_t n0, const int NC, const int R) {
    __m256 acc[4][4];  /* [rows][channels], R <= 4 */
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 xv[4];
        for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(x + r * K + k);
        for (int c = 0; c < NC; c++) {
            __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + (n0 + c) * K + k))));
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(wv, xv[r], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++)
            y[r * N + n0 + c] = i8_hsum(acc[r][c]) * scale[n0 + c] + (bias ? bias[n0 + c] : 0.f);
}

/* 4-row tiles (16 accumulators, 4 rows of x, one weight vector) where AVX512's 32 vector registers hold them; the
 * weights' widening is then shared by 4 rows instead of 2. Each row's operations are the same either way. */
#ifdef __AVX512F__
#define I8_WIDE_ROWS 1
#else
#define I8_WIDE_ROWS 0
#endif
#define I8_TILE(NC, R) i8_tile(x + m * K, K, w, scale, bias, y + m * N, N, n0, NC, R)
#define I8_ROWS(NC)                                    \
    do {                                            \
        int64_t m = 0;                              \
        if (I8_WIDE_ROWS)                              \
            for (; m + 4 <= M; m += 4) I8_TILE(NC, 4); \
        for (; m + 2 <= M; m += 2) I8_TILE(NC, 2);     \
        for (; m < M; m++) I8_TILE(NC, 1);             \
    } while (0)

int sq_int8_linear(const float *x, int64_t M, int64_t K, const int8_t *w, const float *scale, const float *bias,
                   int64_t N, float *y) {
    if (K % 8 || M < 0) return 1;
    const int64_t ntile = (N + 3) / 4;
#pragma omp parallel for schedule(static) if (ntile > 1 && M * N * K > 32768)
    for (int64_t i = 0; i < ntile; i++) {
        const int64_t n0 = i * 4, nc = N - n0 < 4 ? N - n0 : 4;
        switch (nc) {
            case 4: I8_ROWS(4); break;
            case 3: I8_ROWS(3); break;
            case 2: I8_ROWS(2); break;
            default: I8_ROWS(1); break;
        }
    }
    return 0;
}
#else
int sq_int8_linear(const float *x, int64_t M, int64_t K, const int8_t *w, const float *scale, const float *bias,
                   int64_t N, float *y) {
    return 2;
}
#endif
