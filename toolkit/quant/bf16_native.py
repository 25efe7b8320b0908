"""specquant's bf16 dot-product GEMM for x86 CPUs with AVX512-BF16 (toolkit/kernels/bf16_gemm.c): weights stored in
bf16, each row of fp32 activations rounded to bf16, products summed in fp32 by vdpbf16ps; built on first use
(`toolkit.cbuild`).

Why: the native decoder stack's fp16 products (`toolkit.quant.half_native`) widen the weights and multiply at the
fp32 FMA rate. A one-row decode step is bound by the bytes it reads either way, but a speculative verify pass of
6-12 rows is bound by that arithmetic (SmolLM2: a 6-row pass ~1.2-1.6 one-row steps, 12 rows ~2-3), and vdpbf16ps
does two multiply-adds per lane and instruction. `engine.native_dot=bf16` puts a float model's native stack (and its
output head) on this kernel: the arithmetic of a bf16 model (bf16 weights and activations into every product, fp32
sums, norms, attention and KV cache), for decode steps and verify passes alike, so speculative greedy output stays
token-identical to the same engine without speculation. It is not the fp16-weight model's arithmetic: logits move by
bf16 rounding (docs/notes/2026-12-runtime-kernels-native-decoder.md, "bf16 products on the native stack").
`python benchmarks/kernel_gemms.py bf16` times it beside the fp16 kernel.

Packed layout "b16" (made by `pack`): output channels in blocks of 16, blocks in tiles of 4 (the last tile may hold
fewer, nt), each tile stored in the order the kernel reads it: ``w`` bf16 [N*K], tile t at element t*64*K, ordered
[K/2, nt, 16, 2], element (p, b, j, e) = W[16(4t+b)+j, 2p+e]. One 64-byte load is 16 output channels x 2 input
columns, a vdpbf16ps operand; a thread's tiles are one sequential stream.

Constraints: N % 16 == 0, K % 32 == 0. Rows are independent: each row's activations are rounded on their own and a
row's sums run in the same order whatever the number of rows.

AMX: where the CPU has AMX-BF16 (Intel Sapphire Rapids and later) and Linux grants the tile state, the same products
run on the tile unit (`use_amx`, on by default; `SPECQUANT_NO_AMX=1` keeps vdpbf16ps). The b16 pack is already the
tile unit's weight operand, so nothing is repacked. One tile product multiplies up to 16 rows at the cost of about
one, so a speculative verify pass of up to 16 rows costs about a decode step, where vdpbf16ps pays per row (the
"AMX" section of docs/notes/2026-12-runtime-kernels-native-decoder.md has the timings). The tile unit's sums may differ from vdpbf16ps's in the last bits (it
rounds a pair's products its own way, measured here more accurately, and the bias is added after the sums rather
than before): a library that turns it on runs every product there, whatever the rows, so rows stay independent and
decode steps and verify passes agree.
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache

import torch

from toolkit import cbuild
from toolkit.quant import half_native, int4_native

log = logging.getLogger(__name__)

FLAGS = int4_native.FLAGS  # -ffp-contract=off among them
BLOCK_N = 16
TILE = 4
K_MULTIPLE = 32  # the kernel rounds activations 32 columns at a time
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def _self_test(lib) -> str | None:
    x, y = torch.ones(1, 32), torch.empty(1, 16)
    w = pack(torch.ones(16, 32))
    rc = lib.sq_b16_linear(x.data_ptr(), 1, 32, w.data_ptr(), None, 16, y.data_ptr())
    return cbuild.self_test_verdict(rc, torch.equal(y, torch.full((1, 16), 32.0)), "AVX512-BF16")


# `load()`: the library, or None where it cannot be built or the CPU lacks AVX512-BF16 (the function then returns 2)
KERNEL = cbuild.Kernel("bf16_gemm.c", "bf16-gemm", FLAGS, "bf16 dot-product GEMM kernel",
                       "engine.native_dot=bf16 is unavailable", log,
                       {"sq_b16_linear": [_P, _I64, _I64, _P, _P, _I64, _P], "sq_b16_amx": [ctypes.c_int]}, _self_test)
load = KERNEL.load


AMX_OFF_ENV = "SPECQUANT_NO_AMX"  # set to 1: the bf16 products stay on vdpbf16ps where the CPU has AMX
_AMX_LIBRARIES = []  # every library holding this source (this module's and the native decoder's), for `set_amx`


@lru_cache(maxsize=1)
def kernel():
    """The loaded library (function ``sq_b16_linear``), or None: see `load`. Its products run on AMX where `use_amx`
    allows."""
    lib = load()
    if lib is not None:
        use_amx(lib)
    return lib


def use_amx(lib, want: bool | None = None) -> bool:
    """Put `lib`'s bf16 products (a library that compiled bf16_gemm.c: this module's, or the native decoder's) on
    the AMX tile unit, where the CPU and the kernel allow it and the tile path's product of random operands is the
    exact product of their bf16 roundings within fp32 summation rounding; `want` None means unless
    SPECQUANT_NO_AMX=1. Returns whether they run there. Call before the library's first product or between
    products, never while one runs."""
    if lib not in _AMX_LIBRARIES:
        _AMX_LIBRARIES.append(lib)
    if want is None:
        want = os.environ.get(AMX_OFF_ENV, "") in ("", "0")
    if not want or not lib.sq_b16_amx(1):
        lib.sq_b16_amx(0)
        return False
    if not _tile_path_agrees(lib):
        lib.sq_b16_amx(0)
        log.warning("the AMX tile path of the bf16 kernel gave a wrong test product; the kernel stays on vdpbf16ps")
        return False
    return True


def set_amx(want: bool) -> bool:
    """`use_amx` on every library loaded so far (this module's first): benchmarks compare the two paths in one
    process. Returns whether the tile path is on."""
    kernel()
    return all([use_amx(lib, want) for lib in _AMX_LIBRARIES])


def amx_in_use() -> bool:
    """Whether this module's products run on the tile unit."""
    lib = kernel()
    return lib is not None and bool(lib.sq_b16_amx(-1))


def _tile_path_agrees(lib) -> bool:
    generator = torch.Generator().manual_seed(0)
    w, x, bias = torch.randn(48, 64, generator=generator), torch.randn(19, 64, generator=generator), torch.randn(48)
    packed, tile = pack(w), torch.empty(19, 48)
    rc = lib.sq_b16_linear(x.data_ptr(), 19, 64, packed.data_ptr(), bias.data_ptr(), 48, tile.data_ptr())
    exact = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T + bias.double()
    scale = x.to(torch.bfloat16).double().abs() @ w.to(torch.bfloat16).double().abs().T
    return rc == 0 and bool(((tile.double() - exact).abs() <= 1e-6 * scale + 1e-6).all())


def available() -> bool:
    return kernel() is not None


def supports(n: int, k: int) -> bool:
    return n % BLOCK_N == 0 and k > 0 and k % K_MULTIPLE == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The b16 pack (see the module docstring) of an [N, K] weight, as bf16 (its values rounded to bf16)."""
    n, k = weight.shape
    if not supports(n, k):
        raise ValueError(f"the b16 layout needs N % {BLOCK_N} == 0 and K % {K_MULTIPLE} == 0, got a {n}x{k} weight")
    w, step = weight.detach().to(torch.bfloat16), BLOCK_N * TILE
    parts = []
    for n0 in range(0, n, step):
        tile = w[n0:n0 + step]
        blocks = tile.shape[0] // BLOCK_N
        parts.append(tile.reshape(blocks, BLOCK_N, k // 2, 2).permute(2, 0, 1, 3).reshape(-1))
    return torch.cat(parts).contiguous()


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The [N, K] bf16 weight a b16 pack holds (tests, and reading a pack back)."""
    step, rows = BLOCK_N * TILE, []
    for n0 in range(0, n, step):
        blocks = min(step, n - n0) // BLOCK_N
        tile = packed[n0 * k:(n0 + blocks * BLOCK_N) * k].view(k // 2, blocks, BLOCK_N, 2)
        rows.append(tile.permute(1, 2, 0, 3).reshape(blocks * BLOCK_N, k))
    return torch.cat(rows)


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ W.T (+ bias, fp32) for W's b16 pack, x rounded to bf16 per row: [M, n] fp32."""
    return half_native.call(kernel().sq_b16_linear, "bf16", x, packed, n, bias)
