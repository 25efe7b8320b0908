"""specquant's own int8 GEMM for x86 CPUs with AVX512F or AVX2 (toolkit/kernels/int8_gemm.c): symmetric
per-channel int8 codes in the h16 order (`toolkit.quant.half_native`: output channels in blocks of 16, blocks in
tiles of 4, each tile [K, blocks, 16]) and fp32 scales [N], fp32 activations and accumulation; built on first use
(`toolkit.cbuild`) and called through ctypes. QuantLinear's int8 layers on this kernel hold only this pack
(``weight_int8_h16``, 1 byte a weight); the paths that need [N, K] rows (int8 x int8 prefill, dequantize) get them
from `rows`, a copy per call.

Why: torch's ``aten._weight_int8pack_mm`` is vectorized only for bf16 activations. The layout: with each output's
codes in a row of [N, K] (this kernel's earlier layout), a product spent two widenings and part of a
horizontal sum per 8 codes and was bound by those instructions, slower than the same products on fp16 weights
although it read half the bytes (5.3 against 4.3 ms a step of 66M weights, docs/notes/2026-12-runtime-kernels-native-decoder.md); in the h16 order 16 codes of
one input column widen once for every row of the pass and need no horizontal sum. `python
benchmarks/kernel_gemms.py int8` times a SmolLM2 decode step's products against fp16 and torch's int8 kernel (2-core
EPYC: 3.98 ms against 6.74 and 8.09 at one row). Products equal the fp32 weight's to fp32 rounding (no bf16
rounding of the activations), and a row's result never depends on the rows beside it (the kernel's docstring says
why), as speculative verification needs.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from toolkit import cbuild, cpu
from toolkit.quant import half_native

log = logging.getLogger(__name__)

# -ffp-contract=off: the compiler fuses no multiply-add on its own (the kernel's FMAs are explicit), so every tiling
# instance rounds the same way and a row's result does not depend on the rows beside it
FLAGS = ["-O3", *cpu.march(), "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
N_MULTIPLE = half_native.BLOCK_N  # out_features must be a multiple of this (one block of the h16 order)
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def _self_test(lib) -> str | None:
    x, s, y = torch.ones(1, 8), torch.full((16,), 0.5), torch.empty(1, 16)
    w = pack(torch.full((16, 8), 3, dtype=torch.int8))
    rc = lib.sq_int8_linear(x.data_ptr(), 1, 8, w.data_ptr(), s.data_ptr(), None, 16, y.data_ptr())
    return cbuild.self_test_verdict(rc, torch.equal(y, torch.full((1, 16), 12.0)), "AVX2")


# `kernel()`: the library (function ``sq_int8_linear``), or None, with a warning, where it cannot be built or the
# CPU lacks AVX2
KERNEL = cbuild.Kernel("int8_gemm.c", "int8-gemm", FLAGS, "int8 GEMM kernel",
                       "int8 layers run torch's int8 kernel (bf16 activations)", log,
                       {"sq_int8_linear": [_P, _I64, _I64, _P, _P, _P, _I64, _P]}, _self_test)
load, kernel, available = KERNEL.load, KERNEL.library, KERNEL.available


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
