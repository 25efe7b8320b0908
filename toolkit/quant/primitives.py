"""Numeric primitives of group-wise integer weight quantization: choose qparams, quantize, dequantize, pack.

Pure tensor functions in the manner of torchao's quant primitives: no nn.Modules, no I/O, no module swapping.
The RTN / GPTQ / AWQ algorithms and checkpoint export are built on top of these.

Conventions (shared by every function here)
-------------------------------------------
* A weight is a 2-D matrix ``[out_features, in_features]`` (``nn.Linear.weight``). Groups run along the INPUT
  dimension: group ``g`` of row ``o`` is ``weight[o, g*gs:(g+1)*gs]``; ``group_size=-1`` means one group per row.
  Where ``gs`` does not divide ``in_features`` the last group is shorter, quantized as if zero-padded
  (`QuantConfig.n_groups`).
* ``scale`` is float32 ``[out, n_groups]``; ``zero`` is int32 ``[out, n_groups]``; codes ``q`` are uint8
  ``[out, in]`` with values in ``[0, 2**bits - 1]``.
* ``q = clamp(round(w / scale) + zero, 0, maxq)`` and ``w ~= (q - zero) * scale``; ``round`` is ``torch.round``
  (half to even). This is exactly the quantizer of IST-DASLab/gptq ``quant.py`` and AutoGPTQ
  ``auto_gptq/quantization/quantizer.py``, so codes made here are the codes those tools would make.

Packing formats
---------------
* ``int4_rows``: two 4-bit codes per uint8 along the input dimension, low nibble first (see `pack_int4_rows`).
* ``gptq`` (the AutoGPTQ "v1" checkpoint format that transformers, vLLM and gptqmodel load): ``qweight`` int32
  ``[in*bits/32, out]``, ``qzeros`` int32 ``[n_groups, out*bits/32]`` holding ``zero - 1``, ``scales`` fp16
  ``[n_groups, out]``, ``g_idx`` int32 ``[in]`` (see `pack_gptq`, `gptq_scales`, `gptq_g_idx`).
"""

from __future__ import annotations

import dataclasses
import math

import torch

ALLOWED_BITS = (2, 3, 4, 8)
MIN_GROUP_SIZE = 32  # GPTQ kernels pack 32 input codes per block of words; smaller groups buy nothing there
_WORD_BITS = 32
_WORD_MASK = (1 << _WORD_BITS) - 1


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How to quantize a weight: ``bits`` per code, ``group_size`` inputs per scale, ``symmetric`` or not.

    ``group_size`` is a power of two >= 32 (32, 64, 128, ...) or -1 for one group per output channel.
    ``symmetric=True`` fixes the zero point at ``2**(bits-1)`` (GPTQ ``sym=True``); ``False`` uses min/max.
    """

    bits: int = 4
    group_size: int = 128
    symmetric: bool = True

    def __post_init__(self):
        if not _is_int(self.bits) or self.bits not in ALLOWED_BITS:
            raise ValueError(f"QuantConfig.bits must be one of {ALLOWED_BITS}, got {self.bits!r}")
        if not _is_int(self.group_size) or not _valid_group_size(self.group_size):
            raise ValueError(f"QuantConfig.group_size must be -1 (one group per output channel) or a power of two "
                             f">= {MIN_GROUP_SIZE} (32, 64, 128, ...), got {self.group_size!r}")
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"QuantConfig.symmetric must be True or False, got {self.symmetric!r}")

    @property
    def maxq(self) -> int:
        """The largest code, ``2**bits - 1``."""
        return (1 << self.bits) - 1

    def resolve_group_size(self, in_features: int) -> int:
        """The group size for a weight with ``in_features`` inputs (``in_features`` itself for -1). It need not
        divide ``in_features``: the last group is then shorter (see `n_groups`)."""
        if in_features <= 0:
            raise ValueError(f"in_features must be positive, got {in_features}")
        return in_features if self.group_size == -1 else self.group_size

    def n_groups(self, in_features: int) -> int:
        """Groups along the input dim, the last one ragged where the group size does not divide it (SmolLM2's 576
        at 128: 4 whole groups and one of 64). A ragged group quantizes exactly as if zero-padded to a whole one:
        `choose_qparams`' range always contains 0, so the padding changes no scale or zero point, and zero
        columns get the zero point's code. That is how the GPTQ format reads it too (``g_idx = i // group_size``)."""
        return -(-in_features // self.resolve_group_size(in_features))

    def divides(self, in_features: int) -> bool:
        """Whether the groups tile ``in_features`` exactly (what kernels and the AWQ format need)."""
        return in_features % self.resolve_group_size(in_features) == 0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # bool is an int subclass; True bits is a bug


def _valid_group_size(gs: int) -> bool:
    return gs == -1 or (gs >= MIN_GROUP_SIZE and gs & (gs - 1) == 0)


# --------------------------------------------------------------------------------------------- qparams


def pad_to_groups(t: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """``t [out, in]`` with zero columns appended up to ``n_groups * group_size`` (a ragged last group made whole)."""
    in_features = t.shape[1]
    pad = config.n_groups(in_features) * config.resolve_group_size(in_features) - in_features
    return torch.nn.functional.pad(t, (0, pad)) if pad else t


def _as_groups(weight: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """A float32 ``[out, n_groups, group_size]`` of a finite 2-D weight (a ragged last group zero-padded)."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"weight must be a floating-point tensor, got {weight.dtype}")
    w = weight.to(torch.float32)
    if not torch.isfinite(w).all():
        raise ValueError("weight contains NaN or Inf; quantization needs finite values")
    out, in_features = w.shape
    gs = config.resolve_group_size(in_features)
    return pad_to_groups(w, config).reshape(out, config.n_groups(in_features), gs)


def choose_qparams(weight: torch.Tensor, config: QuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group ``(scale [out, n_groups] float32, zero [out, n_groups] int32)`` for ``weight [out, in]``.

    As GPTQ's ``Quantizer.find_params`` (no MSE grid search): the range always contains 0
    (``xmin = min(min, 0)``, ``xmax = max(max, 0)``) so that 0 stays representable;
    asymmetric: ``scale = (xmax - xmin) / maxq``, ``zero = round(-xmin / scale)``;
    symmetric: ``amax = max(|xmin|, xmax)``, range ``[-amax, amax]``, ``scale = 2*amax / maxq``,
    ``zero = 2**(bits-1)`` (GPTQ's ``(maxq + 1) / 2``).
    An all-zero group gets GPTQ's range ``[-1, 1]`` so no scale is 0 (its codes all land on ``zero``).

    One deliberate difference: GPTQ mirrors the range only when the group has a negative value, so a symmetric
    group that is entirely >= 0 gets ``scale = xmax / maxq`` with the zero still mid-range and its upper half
    clips. We always mirror; for any group holding a negative value the result is identical.
    """
    groups = _as_groups(weight, config)
    xmin = groups.amin(dim=-1).clamp(max=0.0)
    xmax = groups.amax(dim=-1).clamp(min=0.0)
    return _qparams_of_range(xmin, xmax, config)


def _qparams_of_range(xmin: torch.Tensor, xmax: torch.Tensor, config: QuantConfig):
    """``(scale, zero)`` whose grid covers ``[xmin, xmax]`` (``xmin <= 0 <= xmax``), by `choose_qparams`' rules."""
    if config.symmetric:
        amax = torch.maximum(-xmin, xmax)
        xmin, xmax = -amax, amax
    empty = (xmin == 0) & (xmax == 0)
    xmin = torch.where(empty, torch.full_like(xmin, -1.0), xmin)
    xmax = torch.where(empty, torch.full_like(xmax, 1.0), xmax)
    scale = (xmax - xmin) / config.maxq
    if not torch.isfinite(scale).all():
        raise ValueError("weight range overflows float32 (max - min > 3.4e38); rescale the weight first")
    # A range below maxq * float32-tiny underflows the scale to 0 or a subnormal; the smallest normal scale
    # still covers the group (range / tiny < maxq), so the error bound holds and nothing divides by zero.
    scale = scale.clamp(min=torch.finfo(torch.float32).tiny)
    if config.symmetric:
        zero = torch.full_like(scale, 1 << (config.bits - 1))
    else:
        zero = torch.round(-xmin / scale).clamp(0, config.maxq)  # in [0, maxq] already; clamp guards rounding
    return scale, zero.to(torch.int32)


def search_qparams(weight: torch.Tensor, config: QuantConfig, *, grid: int = 100, max_shrink: float = 0.8,
                   norm: float = 2.4) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group ``(scale, zero)`` like `choose_qparams`, with the group's range shrunk where that rounds better.

    GPTQ's reference ``Quantizer(mse=True)``: for ``p = 1 - i / grid``, ``i < max_shrink * grid`` (p = 1 is
    `choose_qparams`' range), the range ``[p * xmin, p * xmax]`` gets its qparams by the same rules, and each
    group keeps the p with the smallest ``Σ |dequantize(quantize(w)) - w| ** norm``. Shrinking clips the group's
    largest weights to round the many small ones on a finer grid; ``norm`` 2.4 weighs large errors a little
    more than squared error does. The result never has a larger error (in that norm) than `choose_qparams`'.
    """
    if grid < 1 or not 0.0 < max_shrink < 1.0 or norm <= 0:
        raise ValueError(f"need grid >= 1, 0 < max_shrink < 1 and norm > 0; got {grid}, {max_shrink}, {norm}")
    groups = _as_groups(weight, config).to(torch.float32)
    xmin = groups.amin(dim=-1).clamp(max=0.0)
    xmax = groups.amax(dim=-1).clamp(min=0.0)
    best_scale = best_zero = best_err = None
    for i in range(max(1, int(max_shrink * grid))):
        p = 1.0 - i / grid
        scale, zero = _qparams_of_range(p * xmin, p * xmax, config)
        s, z = scale[..., None], zero.to(torch.float32)[..., None]
        err = ((_grid_codes(groups, scale, zero, config) - z) * s - groups).abs_().pow_(norm).sum(dim=-1)
        if best_err is None:
            best_scale, best_zero, best_err = scale, zero, err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


# --------------------------------------------------------------------------------- quantize / dequantize


def _check_qparams(scale: torch.Tensor, zero: torch.Tensor, out: int, n_groups: int) -> None:
    if tuple(scale.shape) != (out, n_groups) or tuple(zero.shape) != (out, n_groups):
        raise ValueError(f"scale and zero must have shape {(out, n_groups)} [out, n_groups], got "
                         f"{tuple(scale.shape)} and {tuple(zero.shape)}")
    if zero.is_floating_point():
        raise ValueError(f"zero must be an integer tensor, got {zero.dtype}")
    if scale.numel() and not bool((scale > 0).all() & torch.isfinite(scale).all()):
        raise ValueError("scale must be positive and finite (choose_qparams never returns 0)")


def quantize(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """Integer codes ``clamp(round(w / scale) + zero, 0, maxq)`` as uint8, same shape as ``weight``."""
    groups = _as_groups(weight, config)
    out, n_groups, _ = groups.shape
    _check_qparams(scale, zero, out, n_groups)
    return _grid_codes(groups, scale, zero, config).to(torch.uint8).reshape(out, -1)[:, :weight.shape[1]]


def _grid_codes(groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """``clamp(round(w / scale) + zero, 0, maxq)`` as float32 for grouped ``[out, n_groups, gs]`` weights."""
    q = torch.round(groups / scale.to(torch.float32)[..., None]) + zero.to(torch.float32)[..., None]
    return q.clamp_(0, config.maxq)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, config: QuantConfig,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q - zero) * scale`` computed in float32 (the order GPTQ kernels use), returned as ``dtype``."""
    _check_codes(q, config)
    out, in_features = q.shape
    gs, n_groups = config.resolve_group_size(in_features), config.n_groups(in_features)
    _check_qparams(scale, zero, out, n_groups)
    groups = pad_to_groups(q.to(torch.float32), config).reshape(out, n_groups, gs)
    w = (groups - zero.to(torch.float32)[..., None]) * scale.to(torch.float32)[..., None]
    return w.reshape(out, -1)[:, :in_features].to(dtype)


def _check_codes(q: torch.Tensor, config: QuantConfig) -> None:
    if q.dim() != 2:
        raise ValueError(f"codes must be 2-D [out_features, in_features], got shape {tuple(q.shape)}")
    if q.is_floating_point() or q.dtype == torch.bool:
        raise ValueError(f"codes must be an integer tensor, got {q.dtype}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > config.maxq):
        raise ValueError(f"codes must lie in [0, {config.maxq}] for bits={config.bits}, got values in "
                         f"[{int(q.min())}, {int(q.max())}]")


# ------------------------------------------------------------------------------------- int4_rows packing


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``[rows, in]`` into uint8 ``[rows, in/2]``, two codes per byte along the input dim.

    Byte ``j`` of a row holds code ``2j`` in bits 0-3 (low nibble) and code ``2j+1`` in bits 4-7 (high nibble).
    ``in`` must be even.
    """
    _check_codes(q, QuantConfig(bits=4, group_size=-1))
    if q.shape[1] % 2:
        raise ValueError(f"pack_int4_rows needs an even number of columns, got {q.shape[1]}")
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4_rows`: uint8 ``[rows, in/2]`` -> uint8 codes ``[rows, in]``."""
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be a 2-D uint8 tensor, got {packed.dtype} of shape {tuple(packed.shape)}")
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


# ------------------------------------------------------------------------------------------ GPTQ format


def _block(bits: int) -> tuple[int, int]:
    """(codes, words) of the smallest whole block of the bit stream: 8 codes/1 word at 4 bits, 32/3 at 3 bits."""
    g = math.gcd(bits, _WORD_BITS)
    return _WORD_BITS // g, bits // g


def _pack_last_dim(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes ``[..., n]`` into int32 words ``[..., n*bits/32]`` as one LSB-first bit stream.

    Code ``k`` occupies bits ``k*bits .. k*bits+bits-1`` of the stream, and stream bit ``b`` is bit ``b % 32`` of
    word ``b // 32``. For 2/4/8 bits no code crosses a word; for 3 bits, codes 10 and 21 of every 32 straddle
    two words — exactly AutoGPTQ's hand-unrolled 3-bit packer. Computed in int64 so shifts never overflow.
    """
    n_codes, n_words = _block(bits)
    lead, n = codes.shape[:-1], codes.shape[-1]
    blocks = codes.to(torch.int64).reshape(*lead, n // n_codes, n_codes)
    words = torch.zeros(*lead, n // n_codes, n_words, dtype=torch.int64, device=codes.device)
    for k in range(n_codes):
        word, shift = divmod(k * bits, _WORD_BITS)
        code = blocks[..., k]
        words[..., word] |= (code << shift) & _WORD_MASK
        if shift + bits > _WORD_BITS:  # the high bits spill into the next word's low bits
            words[..., word + 1] |= code >> (_WORD_BITS - shift)
    # Reinterpret each unsigned 32-bit pattern as the int32 with the same bits (two's complement).
    words = torch.where(words >= 1 << 31, words - (1 << _WORD_BITS), words)
    return words.to(torch.int32).reshape(*lead, n // n_codes * n_words)


def _unpack_last_dim(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `_pack_last_dim`: int32 ``[..., n*bits/32]`` -> int64 codes ``[..., n]``."""
    n_codes, n_words = _block(bits)
    lead = words.shape[:-1]
    blocks = (words.to(torch.int64) & _WORD_MASK).reshape(*lead, n // n_codes, n_words)
    mask = (1 << bits) - 1
    codes = []
    for k in range(n_codes):
        word, shift = divmod(k * bits, _WORD_BITS)
        code = blocks[..., word] >> shift
        if shift + bits > _WORD_BITS:
            code = code | (blocks[..., word + 1] << (_WORD_BITS - shift))
        codes.append(code & mask)
    return torch.stack(codes, dim=-1).reshape(*lead, n)


def _check_packable(n: int, what: str, bits: int) -> None:
    n_codes, n_words = _block(bits)
    if n % n_codes:
        raise ValueError(f"the GPTQ format packs {n_codes} {bits}-bit codes into {n_words} int32 word(s) along "
                         f"{what}; {what}={n} is not a multiple of {n_codes}")


def pack_gptq(q: torch.Tensor, zero: torch.Tensor, config: QuantConfig, *,
              allow_zero_point_wrap: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack codes ``q [out, in]`` and zero points ``zero [out, n_groups]`` into AutoGPTQ's ``(qweight, qzeros)``.

    Layout (AutoGPTQ ``QuantLinear.pack``, the "gptq" / v1 checkpoint format):

    * ``qweight`` int32 ``[in*bits/32, out]``: column ``o`` is row ``o`` of ``q`` packed along the INPUT dim as
      an LSB-first bit stream — at 4 bits word ``r`` holds inputs ``8r..8r+7``, input ``8r+j`` in bits
      ``4j..4j+3``; at 3 bits each 32 inputs fill 3 words and inputs 10 and 21 straddle a word boundary.
    * ``qzeros`` int32 ``[n_groups, out*bits/32]``: ``zero - 1`` (AutoGPTQ's historical off-by-one; loaders add
      the 1 back) packed the same way along the OUTPUT dim.

    A zero point of 0 (asymmetric groups whose minimum is within scale/2 of 0) has no v1 encoding: it is stored
    as ``maxq``, which gptqmodel decodes back to 0 (it masks after adding 1) but AutoGPTQ/exllama/vLLM kernels
    read as ``2**bits``. So it raises unless ``allow_zero_point_wrap=True``. Symmetric zeros are never 0.
    """
    _check_codes(q, config)
    out, in_features = q.shape
    n_groups = config.n_groups(in_features)
    if tuple(zero.shape) != (out, n_groups) or zero.is_floating_point():
        raise ValueError(f"zero must be an integer tensor of shape {(out, n_groups)} [out, n_groups], got "
                         f"{zero.dtype} {tuple(zero.shape)}")
    _check_packable(in_features, "in_features", config.bits)
    _check_packable(out, "out_features", config.bits)
    if zero.numel() and (int(zero.min()) < 0 or int(zero.max()) > config.maxq):
        raise ValueError(f"zero points must lie in [0, {config.maxq}] for bits={config.bits}")
    if not allow_zero_point_wrap and bool((zero == 0).any()):
        raise ValueError("a zero point is 0, which the GPTQ v1 format (stores zero-1) cannot represent for "
                         "AutoGPTQ/vLLM kernels; quantize symmetrically, or pass allow_zero_point_wrap=True if "
                         "the checkpoint is only read by gptqmodel")
    qweight = _pack_last_dim(q, config.bits).t().contiguous()
    stored = (zero.to(torch.int64) - 1) & config.maxq  # the v1 off-by-one; 0 wraps to maxq (see above)
    qzeros = _pack_last_dim(stored.t(), config.bits)
    return qweight, qzeros


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, config: QuantConfig, in_features: int,
                out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_gptq`: ``(q [out, in] uint8, zero [out, n_groups] int32)`` from v1 tensors."""
    n_groups = config.n_groups(in_features)
    _check_packable(in_features, "in_features", config.bits)
    _check_packable(out_features, "out_features", config.bits)
    want_w = (in_features * config.bits // _WORD_BITS, out_features)
    want_z = (n_groups, out_features * config.bits // _WORD_BITS)
    if tuple(qweight.shape) != want_w or tuple(qzeros.shape) != want_z:
        raise ValueError(f"expected qweight {want_w} and qzeros {want_z} for in={in_features}, out={out_features}, "
                         f"bits={config.bits}; got {tuple(qweight.shape)} and {tuple(qzeros.shape)}")
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"qweight and qzeros must be int32, got {qweight.dtype} and {qzeros.dtype}")
    q = _unpack_last_dim(qweight.t(), config.bits, in_features).to(torch.uint8)
    stored = _unpack_last_dim(qzeros, config.bits, out_features)
    zero = ((stored + 1) & config.maxq).t().contiguous()  # masking matches gptqmodel's per-field correction
    return q, zero.to(torch.int32)


def gptq_scales(scale: torch.Tensor) -> torch.Tensor:
    """``scale [out, n_groups]`` -> GPTQ ``scales`` fp16 ``[n_groups, out]``.

    The fp16 rounding moves the grid slightly; to make codes that match the stored scales exactly, quantize
    with ``scale.half().float()`` (AutoGPTQ's packer re-derives codes from the fp16 scales for the same reason).
    """
    half = scale.t().contiguous().to(torch.float16)
    if not torch.isfinite(half).all():
        raise ValueError("a scale overflows float16 (> 65504); the GPTQ format stores fp16 scales")
    return half


def gptq_g_idx(in_features: int, config: QuantConfig) -> torch.Tensor:
    """GPTQ ``g_idx`` int32 ``[in]``: the group of each input column, ``i // group_size`` (no act-order)."""
    gs = config.resolve_group_size(in_features)
    return (torch.arange(in_features, dtype=torch.int32) // gs).to(torch.int32)
