"""specquant's fp16-weight GEMM for x86 CPUs with AVX512F or AVX2 + F16C (toolkit/kernels/half_gemm.c): fp16 weights widened in
registers, fp32 activations and accumulation, built on first use (`toolkit.cbuild`).

Why: the engine's default float precision is fp16 weights with fp32 activations, which fbgemm's fp16 GEMM runs well
from torch. The native decoder stack (toolkit/engine/native_decoder.py) runs a whole decode step in one C call and
needs the same product in C; this kernel is it, and on this machine it is as fast as fbgemm's or faster (`python
benchmarks/kernel_gemms.py half` prints both: SmolLM2's 960x576 fused q,k,v at a row ~35 against ~48 us). Each output is
the fp16 weight's exact value times the fp32 activation, summed by explicit FMAs in input order: fbgemm's model, its
sums in another order. A row's result never depends on the rows beside it (the same operations in the same order
whatever the number of rows), which is what a speculative verify pass needs from a target.

Packed layout "h16" (made by `pack`): output channels in blocks of 16, blocks in tiles of 4 (the last tile may hold
fewer, nt), each tile stored in the order the kernel reads it: ``w`` fp16 [N*K], tile t at element t*64*K, ordered
[K, nt, 16], element (k, b, j) = W[16(4t+b)+j, k]. One 32-byte load is 16 output channels of one input column, and a
thread's tiles are one sequential stream (the hardware prefetcher follows it). Layers stacked along the output dim
pack as the stacked weight (fused q,k,v and gate,up).

Constraints: N % 16 == 0.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from toolkit import cbuild
from toolkit.quant import int4_native

log = logging.getLogger(__name__)

FLAGS = int4_native.FLAGS  # -ffp-contract=off among them: explicit FMAs only, rows independent
BLOCK_N = 16
TILE = 4
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def _self_test(lib) -> str | None:
    x, y = torch.ones(1, 8), torch.empty(1, 16)
    w = pack(torch.ones(16, 8, dtype=torch.float16))
    rc = lib.sq_f16_linear(x.data_ptr(), 1, 8, w.data_ptr(), None, 16, y.data_ptr())
    return cbuild.self_test_verdict(rc, torch.equal(y, torch.full((1, 16), 8.0)), "AVX2 + F16C + FMA")


# `kernel()`: the library (function ``sq_f16_linear``), or None where it cannot be built or the CPU lacks AVX2 + F16C
# + FMA (the function then returns 2): callers keep fbgemm
KERNEL = cbuild.Kernel("half_gemm.c", "half-gemm", FLAGS, "fp16-weight GEMM kernel", "fp16 layers keep fbgemm", log,
                       {"sq_f16_linear": [_P, _I64, _I64, _P, _P, _I64, _P]}, _self_test)
load, kernel, available = KERNEL.load, KERNEL.library, KERNEL.available


def supports(n: int, k: int) -> bool:
    return n % BLOCK_N == 0 and k > 0


def tile(weight: torch.Tensor) -> torch.Tensor:
    """An [N, K] tensor of any dtype in the h16 order (the module docstring), flat: what `pack` stores for fp16
    weights and the int8 GEMM (`toolkit.quant.int8_native`) for int8 codes."""
    n, k = weight.shape
    if not supports(n, k):
        raise ValueError(f"the h16 layout needs N % {BLOCK_N} == 0, got a {n}x{k} weight")
    w, step = weight.detach(), BLOCK_N * TILE
    full = n // step * step
    parts = [w[:full].reshape(n // step, step, k).transpose(1, 2).reshape(-1)]  # whole tiles: [K, 4, 16] each
    if full < n:  # the last tile, nt < 4 blocks
        parts.append(w[full:].reshape(-1, BLOCK_N, k).permute(2, 0, 1).reshape(-1))
    return torch.cat(parts).contiguous()


def untile(packed: torch.Tensor, n: int, k: int, n0: int = 0, n1: int | None = None) -> torch.Tensor:
    """Rows n0:n1 of the [N, K] tensor whose h16 order `packed` holds, as a fresh [n1 - n0, K] tensor. n0 must
    start a tile (a multiple of 64) and n1 end one (a multiple of 64, or N)."""
    n1 = n if n1 is None else n1
    step = BLOCK_N * TILE
    if packed.numel() != n * k or n0 % step or not (n1 % step == 0 or n1 == n) or not 0 <= n0 <= n1 <= n:
        raise ValueError(f"rows {n0}:{n1} of a {n}x{k} h16 pack of {packed.numel()} elements: bounds must be whole "
                         f"tiles of {step} rows")
    full = min(n1, n // step * step)
    parts = []
    if n0 < full:
        parts.append(packed[n0 * k:full * k].view((full - n0) // step, k, step).transpose(1, 2).reshape(-1, k))
    if full < n1:
        parts.append(packed[full * k:n1 * k].view(k, (n1 - full) // BLOCK_N, BLOCK_N).permute(1, 2, 0).reshape(-1, k))
    return torch.cat(parts) if parts else packed.new_empty(0, k)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The h16 pack (see the module docstring) of an [N, K] weight, as fp16 (its values rounded to fp16 if wider)."""
    return tile(weight.to(torch.float16))


def call(function, what: str, x: torch.Tensor, packed: torch.Tensor, n: int,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ W.T (+ bias, fp32) through `function`, a kernel with this module's signature (x, M, K, flat
    pack, bias, N, y): [M, n] fp32. The fp16 kernel here and the bf16 one (`toolkit.quant.bf16_native`) share it."""
    x = x.contiguous()
    m, k = x.shape
    if x.dtype != torch.float32 or packed.numel() != n * k:
        raise ValueError(f"expected fp32 rows of {packed.numel() // max(n, 1)} columns, got {tuple(x.shape)} {x.dtype}")
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    rc = function(x.data_ptr(), m, k, packed.data_ptr(), None if bias is None else bias.data_ptr(), n, y.data_ptr())
    if rc:
        raise RuntimeError(f"the {what} GEMM kernel failed (rc {rc})")
    return y


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ W.T (+ bias, fp32) for W's h16 pack: [M, n] fp32."""
    return call(kernel().sq_f16_linear, "fp16", x, packed, n, bias)
