"""specquant's own int8 GEMM for x86 CPUs with AVX512F or AVX2 (toolkit/quant/c/int8_gemm.c): symmetric
per-channel int8 codes in the h16 order (`toolkit.quant.half_native`: output channels in blocks of 16, blocks in
tiles of 4, each tile [K, blocks, 16]) and fp32 scales [N], fp32 activations and accumulation; built on first use
(`toolkit.cbuild`) and called through ctypes. QuantLinear's int8 layers on this kernel hold only this pack
(``weight_int8_h16``, 1 byte a weight); the paths that need [N, K] rows (int8 x int8 prefill, dequantize) get them
from `rows`, a copy per call.

Why: torch's ``aten._weight_int8pack_mm`` is vectorized only for bf16 activations. The layout: with each output's
codes in a row of [N, K] (this kernel's earlier layout), a product spent two widenings and part of a
horizontal sum per 8 codes and was bound by those instructions, slower than the same products on fp16 weights
although it read half the bytes (5.3 against 4.3 ms a step of 66M weights, docs/notes/2026-12-runtime-kernels-native-decoder.md); in the h16 order 16 codes of
one input column widen once for every row of the pass and need no horizontal sum. `python -m
toolkit.quant.int8_native` times a SmolLM2 decode step's products against fp16 and torch's int8 kernel (2-core
EPYC: 3.98 ms against 6.74 and 8.09 at one row). Products equal the fp32 weight's to fp32 rounding (no bf16
rounding of the activations), and a row's result never depends on the rows beside it (the kernel's docstring says
why), as speculative verification needs.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from pathlib import Path

import torch

from toolkit import cbuild, cpu
from toolkit.quant import half_native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "c" / "int8_gemm.c"
# -ffp-contract=off: the compiler fuses no multiply-add on its own (the kernel's FMAs are explicit), so every tiling
# instance rounds the same way and a row's result does not depend on the rows beside it
FLAGS = ["-O3", *cpu.march(), "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
N_MULTIPLE = half_native.BLOCK_N  # out_features must be a multiple of this (one block of the h16 order)


def load(flags: tuple[str, ...] = tuple(FLAGS)):
    """Build and load the library; None, with a warning, where it cannot be built or the CPU lacks AVX2."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return cbuild.load_kernel(SOURCE, "int8-gemm", list(flags), "int8 GEMM kernel",
                              "int8 layers run torch's int8 kernel (bf16 activations)", log,
                              {"sq_int8_linear": [p, i64, i64, p, p, p, i64, p]}, _self_test)


def _self_test(lib) -> str | None:
    x, s, y = torch.ones(1, 8), torch.full((16,), 0.5), torch.empty(1, 16)
    w = pack(torch.full((16, 8), 3, dtype=torch.int8))
    rc = lib.sq_int8_linear(x.data_ptr(), 1, 8, w.data_ptr(), s.data_ptr(), None, 16, y.data_ptr())
    return cbuild.self_test_verdict(rc, torch.equal(y, torch.full((1, 16), 12.0)), "AVX2")


@lru_cache(maxsize=1)
def kernel():
    """The loaded library (function ``sq_int8_linear``), or None: see `load`."""
    return load()


def available() -> bool:
    return kernel() is not None


def supports(n: int, k: int) -> bool:
    return n % N_MULTIPLE == 0 and k > 0


def pack(w: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] (N % 16 == 0) in the kernel's layout, the h16 order: a flat int8 tensor of N * K."""
    if w.dtype != torch.int8 or w.dim() != 2:
        raise ValueError(f"expected int8 codes [N, K], got {w.dtype} {tuple(w.shape)}")
    return half_native.tile(w)


def rows(packed: torch.Tensor, n: int, k: int, n0: int = 0, n1: int | None = None) -> torch.Tensor:
    """Codes of output channels n0:n1 as a fresh int8 [n1 - n0, K] (n0 a multiple of 64, n1 too or N)."""
    return half_native.untile(packed, n, k, n0, n1)


def linear(x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x2 [M, K] @ (w * scale[:, None]).T (+ bias) in fp32: `packed` the codes w [N, K] as `pack` made them,
    scale fp32 [N], bias fp32 [N] or None (added in the kernel). Call only where `available()`."""
    if x2.dtype != torch.float32:
        x2 = x2.float()
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m, k = x2.shape
    n = scale.numel()
    if packed.numel() != n * k or not supports(n, k):
        raise ValueError(f"x has {k} features, the int8 pack holds {packed.numel()} codes for {n} outputs "
                         f"({n} x {k} with {n} a multiple of {N_MULTIPLE} needed)")
    y = torch.empty(m, n)
    if m:
        rc = kernel().sq_int8_linear(x2.data_ptr(), m, k, packed.data_ptr(), scale.data_ptr(),
                                     None if bias is None else bias.data_ptr(), n, y.data_ptr())
        if rc:
            raise ValueError(f"the int8 GEMM kernel refused [{n}, {k}] (rc {rc})")
    return y


def _bench(layers: int = 30, row_counts=(1, 6, 17), reps: int = 21) -> None:
    """One decode step's products of SmolLM2-135M's decoder (per layer: fused q,k,v 960x576, o 576x576, fused
    gate,up 3072x576, down 576x1536), weights streamed from memory: this kernel against torch's int8 kernel (bf16
    activations) and specquant's fp16 GEMM (the float model's), the same shapes, alternating; median ms a step."""
    import statistics
    import time

    if not available():
        raise SystemExit("the int8 GEMM kernel is not available here (see the log)")
    g = torch.Generator().manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * layers
    codes = [torch.randint(-127, 128, s, generator=g).to(torch.int8) for s in shapes]
    scales = [torch.rand(s[0], generator=g) * 0.01 + 1e-4 for s in shapes]
    ours = [pack(w) for w in codes]
    halves = [half_native.pack(w.float() * s[:, None]) if half_native.available() else None
              for w, s in zip(codes, scales)]
    bf16_scales = [s.bfloat16() for s in scales]
    print(f"{torch.get_num_threads()} threads; {sum(w.numel() for w in codes) / 1e6:.1f}M weights a step; "
          f"median ms a step of {reps}")
    print(f"{'rows':>4} {'specquant int8':>15} {'torch int8 (bf16)':>18} {'specquant fp16':>15}")
    for m in row_counts:
        xs = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
        paths = {
            "int8": lambda: [linear(xs[w.shape[1]], p, s) for w, p, s in zip(codes, ours, scales)],
            "torch": lambda: [torch.ops.aten._weight_int8pack_mm(xs[w.shape[1]].bfloat16(), w, s)
                              for w, s in zip(codes, bf16_scales)],
            "fp16": (lambda: [half_native.linear(xs[w.shape[1]], h, w.shape[0]) for w, h in zip(codes, halves)])
            if half_native.available() else None,
        }
        times = {name: [] for name, f in paths.items() if f}
        for _ in range(reps):
            for name in times:
                start = time.perf_counter()
                paths[name]()
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"{m:>4} {ms['int8']:>15.2f} {ms['torch']:>18.2f} {ms.get('fp16', float('nan')):>15.2f}")


if __name__ == "__main__":
    _bench()
