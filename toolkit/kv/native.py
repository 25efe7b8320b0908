"""The fused KV dequantization kernel (toolkit/kernels/dequant.c): built with the system C compiler on first use
(`toolkit.cbuild`: cached under $SPECQUANT_HOME/kernels, keyed by source, flags and CPU), called through ctypes on the
tensors' memory.

Where no compiler is found or the build fails, `kernel()` returns None once, with a warning, and the cache uses torch
ops (`kv.dequant=torch`, the same values): nothing depends on the kernel being there.
"""

import ctypes
import logging

import torch

from toolkit import cbuild, cpu

log = logging.getLogger(__name__)

# -ffp-contract=off: the compiler fuses no multiply-add on its own, so every product and sum rounds as torch's separate
# ops do (the one fused step, in the rotation, is an explicit fmaf where torch's addcmul_ fuses too): bit-equal
FLAGS = ["-O3", *cpu.march(), "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
MAX_HEAD_DIM = 512  # the kernel's row buffer
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURE = [_I, _P, _I64, _P, _P, _P, _P, _I64, _P, _I64, _I, _I, _I, _I, _I, _I, _P, _P, _I]

# `kernel()`: the library the caches use (its function: sq_dequant), or None, with a warning, where it cannot be
# built; tests `load` the portable path beside the AVX2 one with `-mno-avx2`
KERNEL = cbuild.Kernel("dequant.c", "kv-dequant", FLAGS, "KV dequantization kernel",
                       "using torch ops (slower, same values)", log, {"sq_dequant": _SIGNATURE})
load, kernel = KERNEL.load, KERNEL.library


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def supported(out: torch.Tensor, bits: int) -> bool:
    """Whether the kernel can write `out` (fp32 or bf16 on the CPU, tokens and channels contiguous) at `bits`."""
    return (out.device.type == "cpu" and out.dtype in (torch.float32, torch.bfloat16) and bits in (2, 4, 8)
            and out.shape[-1] <= MAX_HEAD_DIM and out.stride(-1) == 1 and out.stride(-2) == out.shape[-1]
            and out.stride(0) == out.shape[1] * out.stride(1))


def _run(kind: str, codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, out: torch.Tensor, rows: int,
         tokens: int, bits: int, group: int, slots=None, scale_index=None, cos=None, sin=None, lib=None) -> torch.Tensor:
    """One call of sq_dequant: `codes`, `out` with `rows` rows of equal stride; scale/min flattened per row to fp32
    (they are small: [n/G, D] or [n, D/vg] per row)."""
    lib = lib or kernel()
    D = out.shape[-1]
    s, m = scale.float().reshape(rows, -1).contiguous(), mn.float().reshape(rows, -1).contiguous()
    index = [None if t is None else t.to(torch.int64).contiguous() for t in (slots, scale_index)]
    rope = [None if t is None else t.contiguous() for t in (cos, sin)]
    rc = lib.sq_dequant(0 if kind == "keys" else 1, _ptr(codes), codes.stride(-3), *map(_ptr, index), _ptr(s),
                        _ptr(m), s.shape[1], _ptr(out), out.stride(-3), int(out.dtype == torch.bfloat16), rows, tokens,
                        D, bits, group, *map(_ptr, rope), 0 if cos is None else cos.shape[1])
    if rc:
        raise ValueError(f"the KV dequantization kernel refused head dim {D}, group {group}, {tokens} tokens")
    return out


def _rows_contiguous(codes: torch.Tensor) -> torch.Tensor:
    """codes whose tokens and bytes are contiguous and whose leading dims collapse into one row stride."""
    ok = codes.stride(-1) == 1 and codes.stride(-2) == codes.shape[-1]
    if codes.dim() == 4:
        ok = ok and codes.stride(0) == codes.shape[1] * codes.stride(1)
    return codes if ok else codes.contiguous()


def dequantize(kind: str, codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, out: torch.Tensor, bits: int,
               group: int, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, lib=None) -> torch.Tensor:
    """codes [B, H, n, D*bits/8] (uint8; rows may be strided, tokens contiguous) dequantized into `out` [B, H, n, D]
    (checked with `supported`). kind "keys": scale/min [B, H, n/group, 1, D]; "values": [B, H, n, D/group, 1].
    cos/sin [n, pairs] (keys only): rotate pairs (i, i + D/2) back after scaling, as RotaryTable.rotate_ does.
    `lib`: a library from `load` (default: `kernel()`)."""
    B, H, n, _ = out.shape
    if n == 0:
        return out
    return _run(kind, _rows_contiguous(codes), scale, mn, out, B * H, n, bits, group, cos=cos, sin=sin, lib=lib)


def dequantize_gather(kind: str, codes: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor,
                      out: torch.Tensor, bits: int, group: int = 0, scale_index: torch.Tensor | None = None,
                      lib=None) -> torch.Tensor:
    """The paged cache's read: codes [H, slots, D*bits/8] at positions `slots` [m] (int64) dequantized into `out`
    [H, m, D]. kind "keys": scale/min [H, nb, D] with `scale_index` [m] the row of each token; "values": scale/min
    [H, m, D/group] (already gathered per token)."""
    H, m, D = out.shape
    if m == 0:
        return out
    return _run(kind, _rows_contiguous(codes), scale, mn, out, H, m, bits, group or D, slots=slots,
                scale_index=scale_index, lib=lib)
