/* What the tiled GEMM kernels share (int4_gemm.c, int8_gemm.c, half_gemm.c, bf16_gemm.c, vnni_gemm.c): the loop over
 * output tiles on the OpenMP threads, and the dispatch that turns a tile's block count and a pass's row count into
 * compile-time constants, so that each kernel's inlined tile function runs loops of constant bounds.
 *
 * Control flow only: every product's arithmetic, and its order, stays in the kernel's own tile function. A tile is one
 * thread's whole work and a row's sums run in the same order whatever the number of rows, the passes or the threads,
 * so a row's result never depends on the rows beside it -- what speculative verification needs from a target.
 *
 * The macros name the loop variables the kernels' TILE macros read: `i` (the tile), `nb` (its blocks), `m` (a pass's
 * first row).
 */
#ifndef SQ_TILES_H
#define SQ_TILES_H

#include <stdint.h>

/* a tile function: always inlined, so that its block and row counts become constants */
#define SQ_INLINE static inline __attribute__((always_inline))

#define SQ_PRAGMA(text) _Pragma(#text)

/* for (i = 0; i < ntile; i++) over the output tiles: on the OpenMP threads where there is more than one tile and the
 * product's multiply-adds (`work`) pay for the threads, serial below */
#define SQ_FOR_EACH_TILE(i, ntile, work)                                             \
    SQ_PRAGMA(omp parallel for schedule(static) if ((ntile) > 1 && (work) > 32768)) \
    for (int64_t i = 0; i < (ntile); i++)

/* the blocks in tile i when tiles hold `width` of nblk blocks (the last may hold fewer) */
#define SQ_TILE_BLOCKS(nblk, i, width) ((nblk) - (width) * (i) < (width) ? (nblk) - (width) * (i) : (width))

/* ROWS(NB), NB the constant (1 to 4) that nb holds */
#define SQ_BY_BLOCKS(nb, ROWS)   \
    switch (nb) {                \
        case 4: ROWS(4); break;  \
        case 3: ROWS(3); break;  \
        case 2: ROWS(2); break;  \
        default: ROWS(1); break; \
    }

/* tiles of 4 blocks over nblk blocks of outputs (a variable: the threads read it): ROWS(NB) for each tile i */
#define SQ_TILES_OF_4(nblk, work, ROWS)                         \
    do {                                                        \
        const int64_t sq_ntile = (nblk + 3) / 4;                \
        SQ_FOR_EACH_TILE(i, sq_ntile, work) {                   \
            const int64_t nb = SQ_TILE_BLOCKS(nblk, i, 4);      \
            SQ_BY_BLOCKS(nb, ROWS)                              \
        }                                                       \
    } while (0)

/* M rows over one tile in passes of MAX rows (MAX <= 6; a pass costs about the same with 1 row as with MAX, each
 * weight read and widened once per pass), the rest in one smaller pass: TILE(NB, R), R constant, m its first row */
#define SQ_ROW_PASSES(M, MAX, TILE, NB)                          \
    do {                                                         \
        int64_t m = 0;                                           \
        for (; m + (MAX) <= (M); m += (MAX)) TILE(NB, MAX);      \
        switch ((M) - m) {                                       \
            case 5: TILE(NB, 5); break;                          \
            case 4: TILE(NB, 4); break;                          \
            case 3: TILE(NB, 3); break;                          \
            case 2: TILE(NB, 2); break;                          \
            case 1: TILE(NB, 1); break;                          \
            default: break;                                      \
        }                                                        \
    } while (0)

#endif
