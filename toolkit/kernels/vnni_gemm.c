/* y[M,N] = x[M,K] @ W.T (+ bias) for a 4-bit (sq_w4a8_linear) or 8-bit (sq_w8a8_linear) group-quantized W with the
 * activations quantized to int8 on the fly, integer dot products: AVX512-VNNI's vpdpbusd (64 unsigned-by-signed byte
 * products an instruction), or on AVX2 vpmaddubsw + vpmaddwd (4-bit codes only: a code below 16 times an int8 below
 * 128, two products and two of those pairs summed in 16 bits, stays under 2^15, so no sum saturates and the integer
 * sums are the same exact numbers; 8-bit codes would saturate, so sq_w8a8_linear needs VNNI).
 *
 * Layout "v16" (documented in toolkit/quant/vnni.py, packed by vnni.pack): blocks of 16 output channels,
 * tiles of 4 blocks (the last tile may hold fewer, nt), each tile stored in the order the kernel reads it:
 *   codes  tile t at byte t*4*(K/8)*64: [K/8, nt, 64], byte (o, b, 4j + i) = q[n, 8o+i] | q[n, 8o+4+i] << 4,
 *          n = 16(4t+b) + j, i = 0..3
 *   scale  float, tile t at t*4*G_n*16: [G_n, nt, 16]; zero uint8, the same shape:
 *          w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], G_n = ceil(K/G)
 * 8-bit codes (0..255, e.g. symmetric int8 + 128 with zero 128; a per-channel scale repeated for every group) are
 * the same layout a byte per code: tile t at byte t*4*K*16, ordered [K/4, nt, 64], byte (c, b, 4j + i) = q[n, 4c+i].
 * In the 4-bit layout one 64-byte load holds 16 output channels x 8 input columns: its low nibbles are one vpdpbusd's unsigned
 * operand (lane j: columns 8o..8o+3 of channel j), its high nibbles the next one's (columns 8o+4..8o+7); and a
 * thread's tiles are one sequential stream of bytes, which the hardware prefetcher follows (a block-major layout
 * read four blocks at a time is four short streams, and ran at half the memory bandwidth from DRAM).
 *
 * Activations: each row's group of G columns gets its own symmetric int8 scale, xs = max|x| / 127, and codes
 * xq = round(x / xs) (llama.cpp's q8 activations, at the weight's group). Per group g and row m:
 *   y[m, n] += scale[n, g] * xs[m, g] * (sum_k q[n, k] xq[m, k] - zero[n, g] * sum_k xq[m, k])
 * where the integer sums are exact (int32), so the only rounding is the activations' and the fp32 epilogue's.
 * Not the dequantized weight's fp32 product (that is int4_gemm.c): a cheaper approximation of it, for drafts and for
 * targets run at engine.native_dot=int8. The AVX2 and AVX512 builds give the same bits: the integer sums are exact and
 * the fp32 epilogue runs the same operations in the same order.
 *
 * Rows are independent: a row's activations are quantized from that row alone and its sums run in the same order
 * whatever M or the tiling, so a row's result does not depend on the rows beside it.
 *
 * Constraints (checked by the caller, returned as nonzero here): N % 16 == 0, K % 8 == 0, G % 8 == 0; the last
 * group may be short. Without AVX512-VNNI (and AVX512BW) sq_w8a8_linear returns 2, and without AVX2 both do; the
 * caller then keeps the fp32 kernel.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tiles.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

/* one row's group of n columns (n % 16 == 0) to int8 codes; returns the sum of the codes, sets *scale */
SQ_INLINE int32_t quantize_group(const float *x, int64_t n, int8_t *q, float *scale) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    const float m = _mm512_reduce_max_ps(amax);
    *scale = m / 127.f;
    const __m512 inv = _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = 0; i < n; i += 16) {
        /* round half to even (the default rounding mode); |x * inv| <= 127 up to rounding, saturated anyway */
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv));
        v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        sum = _mm512_add_epi32(sum, v);
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(v));
    }
    return _mm512_reduce_add_epi32(sum);
}

/* a group of any multiple of 8 columns: the vector path for multiples of 16, else scalar with the same rounding */
static int32_t quantize_group_any(const float *x, int64_t n, int8_t *q, float *scale) {
    int64_t n16 = n & ~(int64_t)15;
    if (n16 == n) return quantize_group(x, n, q, scale);
    float m = 0.f;
    for (int64_t i = 0; i < n; i++) m = x[i] > m ? x[i] : (-x[i] > m ? -x[i] : m);
    *scale = m / 127.f;
    const float inv = m > 0.f ? 127.f / m : 0.f;
    int32_t s = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t v = (int32_t)__builtin_nearbyintf(x[i] * inv);
        v = v > 127 ? 127 : (v < -127 ? -127 : v);
        q[i] = (int8_t)v;
        s += v;
    }
    return s;
}

/* tile t: its NB blocks of 16 outputs (16*4t ..) x R rows; the loops have constant bounds after inlining */
SQ_INLINE void tile16(const int8_t *xq, const float *xs, const int32_t *xsum, int64_t K, int64_t ng, int64_t G,
                      const uint8_t *codes, const float *sc, const uint8_t *zp, const float *bias, float *y,
                      int64_t N, int64_t t, const int NB, const int R, const int BITS) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int64_t oct = K / 8, b0 = 4 * t;
    codes += t * 4 * oct * 64 * (BITS / 4);
    sc += t * 4 * ng * 16;
    zp += t * 4 * ng * 16;
    __m512 yv[2][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++) yv[r][j] = bias ? _mm512_loadu_ps(bias + (b0 + j) * 16) : _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512i alo[2][4], ahi[2][4];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < NB; j++) alo[r][j] = ahi[r][j] = _mm512_setzero_si512();
        const int64_t o0 = g * G / 8, o1 = o0 + G / 8 < oct ? o0 + G / 8 : oct;
        for (int64_t o = o0; o < o1; o++) {
            __m512i x0[2], x1[2];
            for (int r = 0; r < R; r++) {
                int32_t a, b;
                memcpy(&a, xq + r * K + 8 * o, 4);
                memcpy(&b, xq + r * K + 8 * o + 4, 4);
                x0[r] = _mm512_set1_epi32(a);
                x1[r] = _mm512_set1_epi32(b);
            }
            for (int j = 0; j < NB; j++) {
                __m512i lo, hi;
                if (BITS == 4) { /* one load: columns 8o..8o+3 in the low nibbles, 8o+4..8o+7 in the high ones */
                    const __m512i v = _mm512_loadu_si512((const void *)(codes + (o * NB + j) * 64));
                    lo = _mm512_and_si512(v, low);
                    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                } else { /* 8 bits: one load per four columns */
                    lo = _mm512_loadu_si512((const void *)(codes + (2 * o * NB + j) * 64));
                    hi = _mm512_loadu_si512((const void *)(codes + ((2 * o + 1) * NB + j) * 64));
                }
                for (int r = 0; r < R; r++) {
                    alo[r][j] = _mm512_dpbusd_epi32(alo[r][j], lo, x0[r]);
                    ahi[r][j] = _mm512_dpbusd_epi32(ahi[r][j], hi, x1[r]);
                }
            }
        }
        for (int j = 0; j < NB; j++) {
            const __m512 s = _mm512_loadu_ps(sc + (g * NB + j) * 16);
            const __m512 z = _mm512_cvtepi32_ps(
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(zp + (g * NB + j) * 16))));
            for (int r = 0; r < R; r++) {
                const __m512 a = _mm512_cvtepi32_ps(_mm512_add_epi32(alo[r][j], ahi[r][j]));
                const __m512 t = _mm512_fnmadd_ps(z, _mm512_set1_ps((float)xsum[r * ng + g]), a);
                yv[r][j] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(xs[r * ng + g])), t, yv[r][j]);
            }
        }
    }
    for (int j = 0; j < NB; j++)
        for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * N + (b0 + j) * 16, yv[r][j]);
}

#define TILE16(NB, R) \
    tile16(xq + m * K, xs + m * ng, xsum + m * ng, K, ng, G, codes, scale, zero, bias, y + m * N, N, i, NB, R, BITS)
#define ROWS16(NB)                                               \
    do {                                                         \
        int64_t m = 0;                                           \
        for (; m + 2 <= M; m += 2) TILE16(NB, 2);                \
        for (; m < M; m++) TILE16(NB, 1);                        \
    } while (0)

#define HAS_W8A8 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* one row's group of n columns (n % 8 == 0) to int8 codes, as the AVX512 build's quantize_group: the same max, the
 * same scale and the same round-half-to-even codes; returns the sum of the codes, sets *scale */
static int32_t quantize_group_any(const float *x, int64_t n, int8_t *q, float *scale) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 amax = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float m = _mm_cvtss_f32(m4);
    *scale = m / 127.f;
    const __m256 inv = _mm256_set1_ps(m > 0.f ? 127.f / m : 0.f);
    __m256i sum = _mm256_setzero_si256();
    for (int64_t i = 0; i < n; i += 8) {
        __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
        v = _mm256_max_epi32(_mm256_min_epi32(v, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
        sum = _mm256_add_epi32(sum, v);
        const __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64((__m128i *)(q + i), _mm_packs_epi16(p16, p16));
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    return _mm_cvtsi128_si32(s4);
}

/* tile t, R rows (1 or 2): blocks J0 .. J0+NP-1 of its NB blocks of 16 outputs, each as two 8-lane halves (a tile's
 * codes are stored [K/8, NB, 64], hence the stride NB). Two rows share each load and unpacking of the codes; their 16
 * int32 accumulators, broadcasts and constants fit AVX2's 16 registers for NP <= 2 (NP 4 with one row). y holds the
 * bias (or zeros) and takes each group's term in turn: yv = fma(scale * xs, sum - zero * xsum, yv), the AVX512 tile's
 * operations lane for lane, so the two builds give the same bits and a row's result is the same whatever R */
SQ_INLINE void tile16_avx2(const int8_t *xq, const float *xs, const int32_t *xsum, int64_t K, int64_t ng, int64_t G,
                           const uint8_t *codes, const float *sc, const uint8_t *zp, float *y, int64_t N, int64_t t,
                           const int NB, const int J0, const int NP, const int R) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int64_t oct = K / 8, b0 = 4 * t;
    codes += t * 4 * oct * 64;
    sc += t * 4 * ng * 16;
    zp += t * 4 * ng * 16;
    for (int64_t g = 0; g < ng; g++) {
        __m256i acc[2][4][2];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < NP; j++) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_si256();
        const int64_t o0 = g * G / 8, o1 = o0 + G / 8 < oct ? o0 + G / 8 : oct;
        for (int64_t o = o0; o < o1; o++) {
            __m256i x0[2], x1[2];
            for (int r = 0; r < R; r++) {
                int32_t a, b;
                memcpy(&a, xq + r * K + 8 * o, 4);
                memcpy(&b, xq + r * K + 8 * o + 4, 4);
                x0[r] = _mm256_set1_epi32(a);
                x1[r] = _mm256_set1_epi32(b);
            }
            for (int j = 0; j < NP; j++)
                for (int h = 0; h < 2; h++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + (o * NB + J0 + j) * 64 + 32 * h));
                    const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    for (int r = 0; r < R; r++) {
                        const __m256i pairs =
                            _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0[r]), _mm256_maddubs_epi16(hi, x1[r]));
                        acc[r][j][h] = _mm256_add_epi32(acc[r][j][h], _mm256_madd_epi16(pairs, ones));
                    }
                }
        }
        for (int j = 0; j < NP; j++)
            for (int h = 0; h < 2; h++) {
                const int64_t at = (g * NB + J0 + j) * 16 + 8 * h;
                const __m256 s = _mm256_loadu_ps(sc + at);
                const __m256 z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(zp + at))));
                for (int r = 0; r < R; r++) {
                    const __m256 d = _mm256_fnmadd_ps(z, _mm256_set1_ps((float)xsum[r * ng + g]),
                                                      _mm256_cvtepi32_ps(acc[r][j][h]));
                    float *yp = y + r * N + (b0 + J0 + j) * 16 + 8 * h;
                    _mm256_storeu_ps(yp, _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(xs[r * ng + g])), d,
                                                         _mm256_loadu_ps(yp)));
                }
            }
    }
}

#define TILE16_AVX2(NB, J0, NP, R) \
    tile16_avx2(xq + m * K, xs + m * ng, xsum + m * ng, K, ng, G, codes, scale, zero, y + m * N, N, i, NB, J0, NP, R)
/* row pairs over the tile's blocks two at a time, then a last row over all of them at once */
#define ROWS16(NB)                                                         \
    do {                                                                   \
        int64_t m = 0;                                                     \
        for (; m + 2 <= M; m += 2) {                                       \
            TILE16_AVX2(NB, 0, (NB) < 2 ? (NB) : 2, 2);                    \
            if ((NB) > 2) TILE16_AVX2(NB, 2, (NB) - 2, 2);                 \
        }                                                                  \
        if (m < M) TILE16_AVX2(NB, 0, NB, 1);                              \
    } while (0)
#define HAS_W8A8 0
#endif

#if defined(HAS_W8A8)
SQ_INLINE int lowbit_q8_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scale,
                               const uint8_t *zero, const float *bias, int64_t N, int64_t G, float *y,
                               const int BITS) {
    if (N % 16 || K % 8 || G % 8 || G <= 0 || M < 0) return 1;
    if (!HAS_W8A8 && BITS != 4) return 2;
    const int64_t ng = (K + G - 1) / G, nblk = N / 16;
    int8_t *xq = malloc(M * K + 64);
    float *xs = malloc(sizeof(float) * (M * ng + 1));
    int32_t *xsum = malloc(sizeof(int32_t) * (M * ng + 1));
    if (!xq || !xs || !xsum) {
        free(xq), free(xs), free(xsum);
        return 3;
    }
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ng; g++) {
            const int64_t k0 = g * G, n = k0 + G < K ? G : K - k0;
            xsum[m * ng + g] = quantize_group_any(x + m * K + k0, n, xq + m * K + k0, xs + m * ng + g);
        }
#if !HAS_W8A8 /* the AVX2 tile adds each group's term to y: start it at the bias */
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) y[m * N + n] = bias ? bias[n] : 0.f;
#endif
    SQ_TILES_OF_4(nblk, M * N * K, ROWS16);
    free(xq);
    free(xs);
    free(xsum);
    return 0;
}

int sq_w4a8_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scale,
                   const uint8_t *zero, const float *bias, int64_t N, int64_t G, float *y) {
    return lowbit_q8_linear(x, M, K, codes, scale, zero, bias, N, G, y, 4);
}

int sq_w8a8_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scale,
                   const uint8_t *zero, const float *bias, int64_t N, int64_t G, float *y) {
    return lowbit_q8_linear(x, M, K, codes, scale, zero, bias, N, G, y, 8);
}
#else
int sq_w4a8_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scale,
                   const uint8_t *zero, const float *bias, int64_t N, int64_t G, float *y) {
    return 2;
}

int sq_w8a8_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scale,
                   const uint8_t *zero, const float *bias, int64_t N, int64_t G, float *y) {
    return 2;
}
#endif
