"""specquant's own int4 GEMM for x86 CPUs with AVX2 (toolkit/kernels/int4_gemm.c): 4-bit group-quantized weights,
fp32 activations and accumulation, built on first use (`toolkit.cbuild`) and called through ctypes.

Why not torch's kernel: ``aten._weight_int4pack_mm_for_cpu`` is vectorized only for bf16 activations, and on AVX2
(no native bf16) it spends its time widening bf16 and scales rather than reading weights. Measured here for
SmolLM2's 1536x576 MLP shape, one row, 2 threads, weights in cache (`python benchmarks/kernel_gemms.py int4`): this
kernel ~26-30 us, torch's int4 ~78 us, fbgemm fp16 ~38 us, with four times the bytes of int4. It also needs no bf16
rounding of the activations, so it is closer to the dequantized weight's fp32 product than torch's kernel is.

Packed layout "n8" (made by `pack`, read back by `unpack_codes`; CPU-independent, but still built at load time from
the checkpoint's codes like every runtime layout):

* ``codes`` uint8 [N/8, K/2, 8]: byte (b, p, j) holds code q[8b+j, 2p] in its low nibble and q[8b+j, 2p+1] in its
  high nibble. A block of 8 output channels fills one 256-bit register of fp32; one 8-byte load feeds two input
  columns.
* ``scale`` fp32 [N/8, G_n, 8] and ``zero`` uint8 [N/8, G_n, 8], G_n = ceil(K / group): the weight is
  ``w[n, k] = (q[n, k] - zero[n, k // group]) * scale[n, k // group]``, GPTQ's integer zero point convention
  (`QuantizedWeight`), not torch's float offset.

Constraints: N % 8 == 0, K and group even; the last group may be short (SmolLM2's 576 at group 128 needs no
padding). Each output row is computed by the same operations in the same order whatever the number of rows or
the tiling, so a row's result never depends on the rows beside it: speculative verification of k+1 positions gives
each position exactly the one-row answer.

Layers stacked along the output dim are the stack of their packs (block-major along N), which the lean forward's
fused q,k,v and gate,up packs use.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from toolkit import cbuild, cpu

log = logging.getLogger(__name__)

# -ffp-contract=off: the compiler fuses no multiply-add on its own (the kernel's FMAs are explicit), so every tiling
# instance rounds the same way and a row's result does not depend on the rows beside it
FLAGS = ["-O3", *cpu.march(), "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
BLOCK_N = 8  # output channels per block of the n8 layout
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def _self_test(lib) -> str | None:
    x, y = torch.ones(1, 16), torch.empty(1, 8)
    codes, scale, zero = pack(torch.ones(8, 16, dtype=torch.uint8), torch.ones(8, 1), torch.zeros(8, 1), 16)
    rc = lib.sq_int4_linear(x.data_ptr(), 1, 16, codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), None, 8, 16,
                            y.data_ptr())
    return None if rc == 0 and torch.equal(y, torch.full((1, 8), 16.0)) else f"rc {rc}"


# `kernel()`: the library (functions ``sq_int4_linear``, ``sq_int4_dequant``), or None, with a warning, where it
# cannot be built or the CPU lacks AVX2 (the function reports it): the caller then keeps torch's int4 kernel
KERNEL = cbuild.Kernel("int4_gemm.c", "int4-gemm", FLAGS, "int4 GEMM kernel",
                       "int4 layers run torch's int4 kernel (slower on AVX2)", log,
                       {"sq_int4_linear": [_P, _I64, _I64, _P, _P, _P, _P, _I64, _I64, _P],
                        "sq_int4_dequant": [_P, _P, _P, _I64, _I64, _I64, _I64, _I64, _P, ctypes.c_int]}, _self_test)
load, kernel, available = KERNEL.load, KERNEL.library, KERNEL.available


def supports(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the n8 layout holds an [out, in] weight at this group size (see the module docstring)."""
    return (out_features % BLOCK_N == 0 and in_features % 2 == 0 and group_size % 2 == 0 and group_size > 0
            and in_features > 0)


def group_count(n: int, k: int, group_size: int, scale: torch.Tensor, zero: torch.Tensor) -> int:
    """ceil(k / group_size), the groups of a row; raises ValueError unless scale and zero are [n, that] (the packs'
    check, here and in `toolkit.quant.vnni`)."""
    n_groups = -(-k // group_size)
    if tuple(scale.shape) != (n, n_groups) or tuple(zero.shape) != (n, n_groups):
        raise ValueError(f"scale and zero must be [{n}, {n_groups}], got {tuple(scale.shape)}, {tuple(zero.shape)}")
    return n_groups


def pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [N, K] (values 0..15), scale [N, G_n], zero [N, G_n] (integer zero points 0..255) -> the n8 layout's
    (codes uint8 [N/8, K/2, 8], scale fp32 [N/8, G_n, 8], zero uint8 [N/8, G_n, 8])."""
    n, k = codes.shape
    if not supports(n, k, group_size):
        raise ValueError(f"the n8 int4 layout needs out % 8 == 0 and even in and group; got [{n}, {k}], group "
                         f"{group_size}")
    n_groups = group_count(n, k, group_size, scale, zero)
    c = codes.to(torch.uint8).reshape(n // BLOCK_N, BLOCK_N, k // 2, 2)
    packed = (c[..., 0] | (c[..., 1] << 4)).permute(0, 2, 1).contiguous()

    def blocked(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(dtype).reshape(n // BLOCK_N, BLOCK_N, n_groups).permute(0, 2, 1).contiguous()

    return packed, blocked(scale, torch.float32), blocked(zero, torch.uint8)


def unpack_codes(packed: torch.Tensor, b0: int = 0, b1: int | None = None, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """The codes of blocks b0:b1 of an n8 pack as [(b1-b0)*8, K] uint8 (`pack`'s inverse), into `out` if given."""
    c = packed[b0:b1]
    nb, half = c.shape[0], c.shape[1]
    both = torch.stack([c & 15, c >> 4], dim=-1)  # [nb, K/2, 8, 2]
    codes = both.permute(0, 2, 1, 3).reshape(nb * BLOCK_N, half * 2)
    if out is None:
        return codes
    return out.copy_(codes)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, b0: int, b1: int,
               out: torch.Tensor) -> torch.Tensor:
    """The float weight of blocks b0:b1 of an n8 pack, ``(q - zero) * scale``, into `out` ([(b1-b0)*8, K], fp32 or
    bf16, contiguous) in one C pass: fp32 bit for bit what `unpack_codes` and torch's arithmetic give, bf16 its
    round-to-nearest-even cast. Call only where `available()`."""
    n, k = codes.shape[0] * BLOCK_N, codes.shape[1] * 2
    if (out.dtype not in (torch.float32, torch.bfloat16) or not out.is_contiguous()
            or out.shape != ((b1 - b0) * BLOCK_N, k)):
        raise ValueError(f"dequantize needs a contiguous fp32/bf16 [{(b1 - b0) * BLOCK_N}, {k}] out, got "
                         f"{out.dtype} {tuple(out.shape)}")
    rc = kernel().sq_int4_dequant(codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), n, k, group_size, b0, b1,
                                  out.data_ptr(), int(out.dtype == torch.bfloat16))
    if rc:
        raise ValueError(f"the int4 dequantize kernel refused blocks {b0}:{b1} of [{n}, {k}] at group {group_size} "
                         f"(rc {rc})")
    return out


def blocked_to_rows(t: torch.Tensor) -> torch.Tensor:
    """A [N/8, G_n, 8] scale or zero of the n8 layout as [N, G_n] (a view)."""
    return t.permute(0, 2, 1).reshape(t.shape[0] * BLOCK_N, t.shape[1])


def linear(x2: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x2 [M, K] @ W.T (+ bias) in fp32, W the n8 pack (`pack`); x2 is used as fp32 contiguous rows,
    bias (fp32 [N]) is added in the kernel. Call only where `available()`."""
    if x2.dtype != torch.float32:
        x2 = x2.float()
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m, k = x2.shape
    n = codes.shape[0] * BLOCK_N
    if k != codes.shape[1] * 2:
        raise ValueError(f"x has {k} features, the int4 pack {codes.shape[1] * 2}")
    y = torch.empty(m, n)
    if m:
        rc = kernel().sq_int4_linear(x2.data_ptr(), m, k, codes.data_ptr(), scale.data_ptr(), zero.data_ptr(),
                                     None if bias is None else bias.data_ptr(), n, group_size, y.data_ptr())
        if rc:
            raise ValueError(f"the int4 GEMM kernel refused [{n}, {k}] at group {group_size} (rc {rc})")
    return y
