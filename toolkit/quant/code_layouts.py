"""How `QuantLinear` (`toolkit.quant.qlinear`) lays its codes out and reads them back: the group torch's int4 kernel
can run a weight with, act-order weights' column order, decoding torch's CPU int4pack layout, and unpacking the
dequant path's packed rows."""

from __future__ import annotations

import torch

from toolkit.quant.kernels import INT4_GROUP_SIZES, INT4_N_MULTIPLE

__all__ = ["INT4PACK_BLOCK_N", "decode_int4pack", "group_order", "int4_kernel_group", "unpack_rows"]

INT4PACK_BLOCK_N = 32  # output rows per block of the CPU int4 packed layout (AVX2); verified at construction


def group_order(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The input channels sorted by group (int32 [in], stable), where that makes the groups ``j // group_size``
    (every group ``group_size`` channels, the last one the rest: act-order GPTQ's g_idx); else None."""
    g = g_idx.long().cpu()
    order = torch.argsort(g, stable=True)
    if not torch.equal(g[order], torch.arange(g.numel()) // group_size):
        return None
    return order.to(torch.int32)


def int4_kernel_group(out_f: int, in_f: int, gs: int) -> int | None:
    """The group size the int4 kernel can run this weight with, or None. A per-channel weight (gs == in) runs
    as the largest kernel group dividing it, its scales repeated; otherwise the weight's own group must be one."""
    if out_f % INT4_N_MULTIPLE or in_f % 2 or in_f == 0:
        return None
    if gs in INT4_GROUP_SIZES and in_f % gs == 0:
        return gs
    if gs == in_f:
        fits = [g for g in INT4_GROUP_SIZES if in_f % g == 0]
        return fits[-1] if fits else None
    return None


def decode_int4pack(packed: torch.Tensor, n: int, k: int, n0: int, n1: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Codes of output rows n0:n1 as W.T [k, n1-n0] from ``_convert_weight_to_int4pack_for_cpu``'s AVX2 layout:
    blocks of 32 rows, each ``[k, 16]`` bytes with byte ``i`` = row ``i`` (low nibble) | row ``16+i`` (high); a tail
    of t < 32 rows is ``[k, t/2]`` bytes with byte ``i`` = row ``2i`` | row ``2i+1``. n0 must be a multiple of 32
    and n1 one too or n. Found by packing probes; `QuantLinear.from_quantized` verifies it against the codes.
    Written into `out` (any dtype, contiguous [k, n1-n0]) if given, else into a new uint8 tensor."""
    b, half = INT4PACK_BLOCK_N, INT4PACK_BLOCK_N // 2
    flat = packed.reshape(-1)
    if out is None:
        out = torch.empty(k, n1 - n0, dtype=torch.uint8, device=packed.device)
    full_end = min(n1, n // b * b)
    nb = (full_end - n0) // b if full_end > n0 else 0
    if nb:
        p = flat[n0 * k // 2:(n0 + nb * b) * k // 2].view(nb, k, half).transpose(0, 1)  # [k, nb, 16]
        o = out[:, :nb * b].view(k, nb, 2, half)
        o[:, :, 0].copy_(p & 0x0F)
        o[:, :, 1].copy_(p >> 4)
    t0 = n0 + nb * b
    if n1 > t0:  # the tail block (fewer than 32 rows, even: n % 16 == 0)
        t = n1 - t0
        p = flat[t0 * k // 2:].view(k, t // 2)
        o = out[:, nb * b:].unflatten(1, (t // 2, 2))
        o[..., 0].copy_(p & 0x0F)
        o[..., 1].copy_(p >> 4)
    return out


def unpack_rows(stored: torch.Tensor, layout: str, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Codes [rows, k] from the dequant path's storage, written into `out` (any dtype) if given, else uint8."""
    if out is None:
        out = torch.empty(stored.shape[0], k, dtype=torch.uint8, device=stored.device)
    if layout == "uint8":
        return out.copy_(stored)
    per = 2 if layout == "int4_rows" else 4
    bits, mask = 8 // per, (1 << (8 // per)) - 1
    o = out.view(stored.shape[0], k // per, per)
    for i in range(per):
        o[..., i].copy_((stored >> (bits * i)) & mask if i < per - 1 else stored >> (bits * i))
    return out
