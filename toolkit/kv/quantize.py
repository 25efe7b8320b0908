"""Pure KV quantization primitives (KIVI): asymmetric min/max codes of 8, 4 or 2 bits, packed along the head dim.

Keys are quantized per channel over a group of tokens (outlier channels get their own scale, as KIVI found keys
need); values per token over a group of channels. Both reduce to one function, `quantize_groups`, that takes the
min/max over one axis of a `[..., group, channels]` block.

Scales and minima are stored as float16 (what decides the memory ratio) and the codes are computed from the stored
fp16 values, with the minimum rounded down and the scale rounded up to fp16, so that every x lies in
[min, min + maxq * scale] and |x - dequantize(quantize(x))| <= scale / 2 holds for the stored scale.

`clip_grid` (values at 2 bits): the range [min, max] may shrink about its centre by one of a few factors, chosen
per group for the least squared error. At 4 levels min/max spends most of them on the tails of a token's values;
a tighter range rounds the bulk finer and clips a few. The bound above then holds only inside the chosen range.
Keys are never clipped: their rare large entries (outlier tokens) are what attention reads most.

Hierarchical INT8 (QuantSpec): an 8-bit code c = 16 * hi + lo is kept as two 4-bit planes; the `hi` plane alone is
a valid INT4 quantization with scale 16 * s and the bucket centre as its value (see `dequantize_hi`).
"""

import torch

ALLOWED_BITS = (2, 4, 8)
STORE_DTYPE = torch.float16  # scales and minima


def _round_half(x: torch.Tensor, down: bool) -> torch.Tensor:
    """x (fp32) rounded to fp16 toward -inf (down) or +inf, so the stored value bounds the true one."""
    h = x.to(STORE_DTYPE)
    off = h.float() > x if down else h.float() < x
    if off.any():
        toward = torch.full_like(h, float("-inf") if down else float("inf"))
        h = torch.where(off, torch.nextafter(h, toward), h)
    return h


CLIP_GRID = tuple(1.0 - 0.05 * i for i in range(10))  # range factors tried by the clip search: 1.0 (min/max) .. 0.55


def quantize_groups(x: torch.Tensor, bits: int, dim: int,
                    clip_grid: tuple[float, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8, unpacked) and fp16 (scale, minimum) reduced over `dim` of x (kept as size 1); with `clip_grid`,
    each group's range is the one of `factor * (max - min)` about its centre with the least squared error."""
    if bits not in ALLOWED_BITS:
        raise ValueError(f"KV bits must be one of {ALLOWED_BITS}, got {bits}")
    x = x.float()
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    if not clip_grid:
        return _codes(x, bits, lo, hi)
    # every candidate at once along a new leading dim (a flush quantizes a few tokens: op count, not size, is the cost)
    factor = torch.tensor(clip_grid, dtype=x.dtype, device=x.device).view(-1, *([1] * x.dim()))
    centre, half = (lo + hi) / 2, (hi - lo) / 2
    codes, scale, mn = _codes(x, bits, centre - factor * half, centre + factor * half)
    err = (torch.addcmul(mn.float(), codes.float(), scale.float()) - x).square_().sum(dim, keepdim=True)
    best = err.argmin(0, keepdim=True)  # the first of equals: min/max (factor 1.0) wins a tie

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.gather(0, best.expand(1, *t.shape[1:])).squeeze(0)

    return pick(codes), pick(scale), pick(mn)


def _codes(x: torch.Tensor, bits: int, lo: torch.Tensor, hi: torch.Tensor):
    """Codes of x on the grid from lo to hi (clamped to it), with its fp16 scale and minimum."""
    maxq = 2**bits - 1
    mn = _round_half(lo, down=True)
    scale = _round_half(((hi - mn.float()) / maxq).clamp_min(1e-6), down=False)
    codes = ((x - mn.float()) / scale.float()).round_().clamp_(0, maxq).to(torch.uint8)
    return codes, scale, mn


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, dtype) -> torch.Tensor:
    """codes * scale + min (broadcast), in `dtype`; computed in fp32 so every dtype sees the same values."""
    return torch.addcmul(mn.float(), codes.float(), scale.float()).to(dtype)


def dequantize_hi(hi: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, dtype) -> torch.Tensor:
    """The INT4 reading of hierarchical INT8 codes from the high nibbles only: code 16*hi + 7.5 (the bucket's
    centre), so |x - value| <= 8 * scale = (16 * scale) / 2, an INT4 quantizer's bound at step 16 * scale."""
    return torch.addcmul(mn.float(), hi.float() * 16 + 7.5, scale.float()).to(dtype)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., n] -> [..., n * bits / 8], lowest bits first (n a multiple of 8 / bits)."""
    if bits == 8:
        return codes.contiguous()
    per = 8 // bits
    c = codes.view(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = c[..., 0].clone()
    for i in range(1, per):
        out |= c[..., i] << (bits * i)
    return out


_SHIFTS = {b: torch.arange(0, 8, b, dtype=torch.uint8) for b in (2, 4)}


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`."""
    if bits == 8:
        return packed
    shifts = _SHIFTS[bits].to(packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)
    return codes.view(*packed.shape[:-1], packed.shape[-1] * (8 // bits))


def unpack_into(packed: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """`unpack`, written as floats into `out` [..., n * 8 / bits] (any float dtype, may be a strided view): one
    masked shift per code position, each a plain elementwise op. Twice as fast as `unpack(...).float()` at 8k
    tokens, whose broadcast shift over a trailing dim of 8 / bits does not vectorize."""
    if bits == 8:
        return out.copy_(packed)
    per, mask = 8 // bits, 2**bits - 1
    view = out.view(*packed.shape, per)
    for i in range(per):
        shifted = packed >> (bits * i) if i else packed
        view[..., i] = shifted & mask if i < per - 1 else shifted
    return out


def split_planes(codes8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes -> (hi, lo) 4-bit planes, each packed two per byte: the draft reads `hi` alone."""
    return pack(codes8 >> 4, 4), pack(codes8 & 15, 4)


def join_planes(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    return (unpack(hi, 4) << 4) | unpack(lo, 4)
