"""Low-bit weights x int8 activations on integer dot products (toolkit/kernels/vnni_gemm.c): a draft's products, and
an int4 target's at `engine.native_dot=int8`.

Why: a drafted token only has to be likely, not exact (the target verifies it), and a small model's int4 decode step
on these cores is bound by the fp32 kernel's arithmetic (`toolkit.quant.int4_native`: per weight an unpack, a
conversion and an FMA), not by the bytes it reads. Quantizing each row's activations to int8 per weight group
(llama.cpp's q8 activations) turns 64 multiply-adds into one vpdpbusd, and the kernel runs near the cost of reading
its weights. Its output is not the dequantized weight's fp32 product (the activations are rounded to 8 bits), so
it serves drafts (`spec.act_bits=8`: the self-draft's int4 decoder stack, "w4a8", and a quantized draft head, int4 or
int8, "w8a8") and, by the user's choice, an int4 target (`engine.native_dot=int8`, docs/engine.md), never a default.
4-bit codes run on AVX512-VNNI (vpdpbusd) or AVX2 (vpmaddubsw + vpmaddwd, the same exact integer sums: the same bits);
8-bit codes need VNNI (AVX2's 16-bit pair sums would saturate): `available(bits=8)`. `python benchmarks/kernel_gemms.py vnni` times it beside the fp32
kernel.

Packed layout "v16" (made by `pack`, or by `from_n8` from the fp32 kernel's n8 packs). Output channels in blocks of
16, blocks in tiles of 4 (the last tile may hold fewer, nt); each tile's bytes in the order the kernel reads them,
so a thread's share of a matrix is one sequential stream, which the hardware prefetcher follows (read block-major,
four blocks at a time, a tile is four short streams: SmolLM2's 120 int4 products of a decode step, one thread,
weights from DRAM, took 3.0 ms that way and 1.9 ms tiled; one run each):

* 4-bit ``codes`` uint8, N*K/2 bytes (held as [N/16, K/8, 64]): tile t at byte t*4*(K/8)*64, ordered [K/8, nt, 64];
  byte (o, b, 4j + i) holds code q[n, 8o+i] in its low nibble and q[n, 8o+4+i] in its high nibble, n = 16(4t+b) + j,
  i = 0..3. One 64-byte load is 16 output channels x 8 input columns; its low nibbles are a vpdpbusd operand whose
  32-bit lane j holds columns 8o..8o+3 of channel j, its high nibbles the next four columns.
* 8-bit ``codes`` uint8 (0..255), N*K bytes (held as [N/16, K/4, 64]): the same with a byte per code, tile t ordered
  [K/4, nt, 64], byte (c, b, 4j + i) = q[n, 4c+i]. Symmetric int8 weights are stored +128 with zero 128.
* ``scale`` fp32 and ``zero`` uint8, N*G_n values each (held as [N/16, G_n, 16]), G_n = ceil(K / group): tile t at
  t*4*G_n*16, ordered [G_n, nt, 16]. ``w[n, k] = (q[n, k] - zero[n, k // group]) * scale[n, k // group]`` (GPTQ's
  integer zero points, as in the n8 layout). The group is also the activations' quantization group; a per-channel
  weight repeats its scale in every group.

Constraints: N % 16 == 0, K % 8 == 0, group % 8 == 0 (the last group may be short). Rows are independent: each row's
activations are quantized from that row alone, so a row's result does not depend on the rows beside it.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache

import torch
from torch import nn

from toolkit import cbuild
from toolkit.quant import int4_native

log = logging.getLogger(__name__)

FLAGS = int4_native.FLAGS
BLOCK_N = 16  # output channels per block of the v16 layout
BLOCK_K = 8  # input columns per 64-byte load of 4-bit codes (4 for 8-bit codes)
BITS = (4, 8)
TILE = 4  # blocks a kernel tile reads together (stored together)
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_SIGNATURE = [_P, _I64, _I64, _P, _P, _P, _P, _I64, _I64, _P]


def _self_test(lib) -> str | None:
    x, y = torch.ones(1, 16), torch.empty(1, 16)
    codes, scale, zero = pack(torch.ones(16, 16, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1), 16)
    rc = lib.sq_w4a8_linear(x.data_ptr(), 1, 16, codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), None, 16,
                            16, y.data_ptr())
    return cbuild.self_test_verdict(rc, torch.allclose(y, torch.full((1, 16), 16.0)), "AVX2")


# `kernel()`: the library (functions ``sq_w4a8_linear``, ``sq_w8a8_linear``), or None where it cannot be built or the
# CPU lacks AVX2 (the functions then return 2): callers keep the fp32 kernel
KERNEL = cbuild.Kernel("vnni_gemm.c", "vnni-gemm", FLAGS, "low-bit x int8 kernel", "products keep fp32 activations",
                       log, {"sq_w4a8_linear": _SIGNATURE, "sq_w8a8_linear": _SIGNATURE}, _self_test)
load, kernel = KERNEL.load, KERNEL.library


def available(bits: int = 4) -> bool:
    """Whether `bits`-bit codes run here: 4 where the kernel built (AVX2 or better), 8 only with AVX512-VNNI."""
    if not KERNEL.available():
        return False
    return bits == 4 or w8a8_runs()


@lru_cache(maxsize=1)
def w8a8_runs() -> bool:
    """Whether the built kernel takes 8-bit codes (its VNNI build) rather than answering 2 (its AVX2 build)."""
    x, y = torch.ones(1, 16), torch.empty(1, 16)
    codes, scale, zero = pack(torch.ones(16, 16, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1), 16, bits=8)
    return kernel().sq_w8a8_linear(x.data_ptr(), 1, 16, codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), None,
                                   16, 16, y.data_ptr()) == 0


def isa_name() -> str:
    """How the kernel's integer dot products run here, for the `kernels` record."""
    return "VNNI" if w8a8_runs() else "AVX2 maddubs"


def supports(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the v16 layout holds an [out, in] weight at this group size (see the module docstring)."""
    return (out_features % BLOCK_N == 0 and in_features % BLOCK_K == 0 and in_features > 0
            and group_size % BLOCK_K == 0 and group_size > 0)


def _per_load(bits: int) -> int:
    """Input columns one 64-byte load of `bits`-bit codes holds per output channel."""
    if bits not in BITS:
        raise ValueError(f"the v16 layout holds 4- or 8-bit codes, not {bits}")
    return 8 if bits == 4 else 4


def pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, bits: int = 4
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [N, K] (values below 2**bits), scale [N, G_n], zero [N, G_n] -> the v16 layout's (codes uint8
    [N/16, K/8, 64] for 4 bits, [N/16, K/4, 64] for 8, scale fp32 [N/16, G_n, 16], zero uint8 [N/16, G_n, 16])."""
    n, k = codes.shape
    cols = _per_load(bits)
    if not supports(n, k, group_size):
        raise ValueError(f"the v16 layout needs out % 16 == 0, in % 8 == 0 and group % 8 == 0; got [{n}, {k}], "
                         f"group {group_size}")
    n_groups = int4_native.group_count(n, k, group_size, scale, zero)
    if bits == 4:
        c = codes.to(torch.uint8).reshape(n // BLOCK_N, BLOCK_N, k // cols, 2, 4)
        c = c[..., 0, :] | (c[..., 1, :] << 4)
    else:
        c = codes.to(torch.uint8).reshape(n // BLOCK_N, BLOCK_N, k // cols, 4)
    packed = c.permute(0, 2, 1, 3).reshape(n // BLOCK_N, k // cols, 64)

    def blocked(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(dtype).reshape(n // BLOCK_N, BLOCK_N, n_groups).permute(0, 2, 1)

    return _tiled(packed), _tiled(blocked(scale, torch.float32)), _tiled(blocked(zero, torch.uint8))


def _tiled(blocks: torch.Tensor) -> torch.Tensor:
    """[blocks, rows, width] in block-major order -> the same shape holding each tile of TILE blocks as
    [rows, blocks of the tile, width] (the v16 layout's byte order)."""
    nblk, rows, width = blocks.shape
    full = nblk // TILE * TILE
    parts = [blocks[:full].reshape(-1, TILE, rows, width).permute(0, 2, 1, 3).reshape(-1)]
    if full < nblk:
        parts.append(blocks[full:].permute(1, 0, 2).reshape(-1))
    return torch.cat(parts).reshape(nblk, rows, width)


def _untiled(tiled: torch.Tensor) -> torch.Tensor:
    """`_tiled`'s inverse."""
    nblk, rows, width = tiled.shape
    full = nblk // TILE * TILE
    flat = tiled.reshape(-1)
    head = flat[:full * rows * width].reshape(-1, rows, TILE, width).permute(0, 2, 1, 3).reshape(full, rows, width)
    if full == nblk:
        return head
    tail = flat[full * rows * width:].reshape(rows, nblk - full, width).permute(1, 0, 2)
    return torch.cat([head, tail])


def unpack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int = 4
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack`'s inverse: codes uint8 [N, K], scale fp32 [N, G_n], zero uint8 [N, G_n]."""
    blocks = _untiled(codes)
    nblk, loads = blocks.shape[:2]
    if _per_load(bits) == 8:
        blocks = torch.stack([blocks & 15, blocks >> 4], dim=-2)
    q = blocks.reshape(nblk, loads, -1, BLOCK_N, 4).permute(0, 3, 1, 2, 4).reshape(nblk * BLOCK_N, -1)

    def rows(t: torch.Tensor) -> torch.Tensor:
        b = _untiled(t)
        return b.permute(0, 2, 1).reshape(b.shape[0] * BLOCK_N, b.shape[1])

    return q, rows(scale), rows(zero)


def from_n8(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The v16 pack of an n8 pack (`toolkit.quant.int4_native`), or None where the v16 layout cannot hold it."""
    n, k = codes.shape[0] * int4_native.BLOCK_N, codes.shape[1] * 2
    if not supports(n, k, group_size):
        return None
    return pack(int4_native.unpack_codes(codes), int4_native.blocked_to_rows(scale),
                int4_native.blocked_to_rows(zero), group_size)


def linear(x2: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
           bias: torch.Tensor | None = None, bits: int = 4) -> torch.Tensor:
    """y [M, N] ~= x2 [M, K] @ W.T (+ bias), W the v16 pack of `bits`-bit codes, x2's rows quantized to int8 per
    group in the kernel; bias fp32 [N]. Call only where `available()`."""
    if x2.dtype != torch.float32:
        x2 = x2.float()
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m, k = x2.shape
    n, width = codes.shape[0] * BLOCK_N, codes.shape[1] * _per_load(bits)
    if k != width:
        raise ValueError(f"x has {k} features, the int{bits} pack {width}")
    y = torch.empty(m, n)
    if m:
        f = kernel().sq_w4a8_linear if bits == 4 else kernel().sq_w8a8_linear
        rc = f(x2.data_ptr(), m, k, codes.data_ptr(), scale.data_ptr(), zero.data_ptr(),
               None if bias is None else bias.data_ptr(), n, group_size, y.data_ptr())
        if rc:
            raise ValueError(f"the int{bits} x int8 kernel refused [{n}, {k}] at group {group_size} (rc {rc})")
    return y


def reference(x2: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel computes, in torch ops from unpacked [N, K] codes and [N, G_n] scale and zero (for tests):
    per-row, per-group symmetric int8 activations (round half to even), exact integer sums, fp32 epilogue."""
    x2 = x2.float()
    m, k = x2.shape
    out = torch.zeros(m, codes.shape[0]) if bias is None else bias.float().expand(m, -1).clone()
    for g, k0 in enumerate(range(0, k, group_size)):
        xg = x2[:, k0:k0 + group_size]
        amax = xg.abs().amax(-1, keepdim=True)
        xs = amax / 127
        # a tensor divided by a tensor: IEEE division, as the kernel's 127.f / m (torch computes a number divided
        # by a tensor as the number times the reciprocal, 1 ulp off at times, which flips a tie x * inv = n + 0.5)
        inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
        xq = torch.round(xg * inv).clamp(-127, 127).to(torch.int64)
        dots = xq @ codes[:, k0:k0 + group_size].to(torch.int64).t()  # exact
        t = dots.float() - zero[:, g].float() * xq.sum(-1, keepdim=True).float()
        out += scale[:, g].float() * xs * t
    return out


class VnniLinear(nn.Module):
    """A Linear layer held as a v16 pack of 4- or 8-bit codes, run with int8 activations (a draft's output head:
    `spec.head_bits` with `spec.act_bits=8`). Float weights are not kept."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, bits: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())
        self.group_size, self.bits = group_size, bits
        self.in_features, self.out_features = codes.shape[1] * _per_load(bits), codes.shape[0] * BLOCK_N

    @classmethod
    def from_quantized(cls, qw, act_group: int = 64) -> VnniLinear:
        """From a `QuantizedWeight` of 4- or 8-bit codes. A per-channel weight (one group) repeats its scale and zero
        in groups of `act_group` columns, the activations' quantization group."""
        group = qw.config.resolve_group_size(qw.in_features)
        scale, zero = qw.scale, qw.zero
        if scale.shape[1] == 1 and group > act_group:
            group = act_group
            n_groups = -(-qw.in_features // group)
            scale, zero = scale.expand(-1, n_groups), zero.expand(-1, n_groups)
        codes, scale, zero = pack(qw.codes, scale, zero, group, qw.config.bits)
        return cls(codes, scale, zero, group, qw.config.bits, qw.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        y = linear(x.reshape(rows, x.shape[-1]), self.codes, self.scale, self.zero, self.group_size, self.bias,
                   self.bits)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, w{self.bits}a8 "
                f"g{self.group_size}")
