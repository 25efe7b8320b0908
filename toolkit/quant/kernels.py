"""Thin wrappers over torch's real low-bit CPU matmul kernels (no fake-quant: the weights stay int8 / packed int4).

Kernels (torch 2.13, CPU):

* ``aten._weight_int8pack_mm(x [M,K], w [N,K] int8, scales [N]) -> [M,N]``: per-output-channel symmetric int8,
  ``y = x @ (w * scales[:, None]).T``.
* ``aten._convert_weight_to_int4pack_for_cpu(q [N,K] int32 in 0..15, inner_k_tiles) -> uint8 [N, K/2]`` and
  ``aten._weight_int4pack_mm_for_cpu(x [M,K], packed, group_size, scales_and_zeros [K/group_size, N, 2]) -> [M,N]``:
  asymmetric group-wise int4 ("tinygemm" convention, as in gpt-fast / torchao), dequantizing as

      w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]      with g = k // group_size

  so ``zero`` is a float offset, not an integer zero point. Min/max quantization gives
  ``zero = min + 8 * scale`` (gpt-fast's ``get_group_qparams``); an integer zero point ``zp`` with
  ``w = (q - zp) * scale`` maps to ``zero = (8 - zp) * scale`` (:func:`int4_zeros_from_zero_point`).

Dtype rules, found by trying them (not documented by torch):

* Activations may be float32, bfloat16 or float16; the output has the activation dtype.
* ``scales`` (int8) and ``scales_and_zeros`` (int4) must have exactly the activation dtype, else the kernel raises
  "expected scalar type ...". Keep one copy per compute dtype; the wrappers cast if they differ (costs a pass).
* On x86 only the **bfloat16** path is vectorized (AVX2 / AVX512 tinygemm kernels). float32 and float16 fall back to
  a scalar loop: on this AVX2 machine (2 threads) int8 is 1.8x and int4 3.7x slower than fp32 ``F.linear`` at M=1,
  and 33x / 65x slower at M=128 (``python -m benchmarks.kernels``). The bf16 path needs no native bf16 math
  (it widens to fp32 and uses FMA), so it is the fast one even here. The wrappers therefore take
  ``compute_dtype``: pass ``torch.bfloat16`` to run the fast path from float32 activations (cast in, cast out).
* Measured here (geomean over SmolLM2 / Qwen2.5-0.5B layer shapes, weights streamed from DRAM): bf16 int4 is
  2.7x fp32 ``F.linear`` and 1.17x the fp16-weight gemv at M=1, 2.8x the gemv at M=4, but 0.61x fp32
  ``F.linear`` at M=128 (prefill should dequantize or keep a float path). bf16 int8: 1.06x / 2.2x / 0.62x.

Shape constraints (the kernels raise ``RuntimeError`` otherwise; the wrappers check first and raise ``InputError``):

* int8: x must be 2-D with a contiguous last dim (the wrapper flattens leading dims and makes it contiguous);
  w int8 [N,K]; scales 1-D of size N. float32 / float16 accept any N and K (odd sizes work).
* int8 with **bfloat16** (the vectorized path) reads activations with *aligned* SIMD loads, 8 (AVX2) or 16 (AVX512)
  values at a time and no tail loop: K not a multiple of 8 reads past the row (garbage or NaN at M=1, segfault at
  M>1, seen here), and an activation not 16-byte (AVX2) / 32-byte (AVX512) aligned segfaults. The AVX512 kernel
  also loads weight rows aligned. The wrapper therefore requires K % 16 == 0 and a 64-byte aligned weight for
  bf16, and copies a misaligned activation. Every layer of SmolLM2 / Qwen2.5 (576, 896, 1536, 4864) qualifies.
* int4: ``group_size`` in {32, 64, 128, 256}; K (in_features) divisible by ``group_size`` (so 576 works with 32/64
  but not 128/256; 896 with 32/64/128 but not 256; 1536 with all four); K even; N (out_features) divisible by 16;
  weight codes int32 for packing. ``inner_k_tiles`` is ignored by the CPU packer (any value gives identical bytes).
* The packed int4 layout depends on the CPU the packer runs on (32-wide column blocks on AVX2, 64-wide on AVX512):
  never save packed tensors across machines. Store the codes / scales / zeros and call
  :func:`prepare_int4_weight` at load time.
"""

from __future__ import annotations

import torch

from toolkit.errors import InputError

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Activation dtypes both kernels accept (other floating dtypes are cast to float32)."""

FAST_DTYPE = torch.bfloat16
"""The only activation dtype with a vectorized kernel on x86 (AVX2 and AVX512) in torch 2.13."""

INT8_BF16_K_MULTIPLE = 16
"""in_features multiple the bf16 int8 kernel needs: 8 on AVX2, 16 on AVX512 (no tail loop); 16 is safe on both."""
_ALIGN = 64  # torch's CPU allocator aligns fresh tensors to 64 bytes; views with an offset may not be

INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_N_MULTIPLE = 16


def _compute_dtype(x: torch.Tensor, compute_dtype: torch.dtype | None) -> torch.dtype:
    if not x.is_floating_point():
        raise InputError(f"activations must be floating point, got {x.dtype}", "pass float32/bfloat16/float16")
    dtype = compute_dtype or (x.dtype if x.dtype in KERNEL_DTYPES else torch.float32)
    if dtype not in KERNEL_DTYPES:
        raise InputError(f"compute_dtype {dtype} is not one the kernels accept",
                         "use torch.float32, torch.bfloat16 or torch.float16")
    return dtype


# The helpers below skip no-op tensor calls: at decode (M=1) a small layer's kernel takes ~15 us here and every
# extra Python-level torch call costs 1-3 us.


def _as_2d(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    if x.dtype != dtype:
        x = x.to(dtype)
    return x if x.is_contiguous() else x.contiguous()


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def _finish(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        y = y + bias.to(y.dtype)
    if x.dim() != 2:
        y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y if y.dtype == x.dtype else y.to(x.dtype)


# --------------------------------------------------------------------------------------------------- int8


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric per-output-channel int8 of a float [N,K] weight: (w_int8 [N,K], scales [N] fp32),
    with ``weight ~= w_int8 * scales[:, None]`` and codes in -127..127. A reference helper for tests and benchmarks."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(w_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight the int8 kernel multiplies by: ``w_int8 * scales[:, None]``."""
    return w_int8.float() * scales.float()[:, None]


def int8_weight_linear(x: torch.Tensor, w_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                       *, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``y = x @ (w_int8 * scales[:, None]).T (+ bias)`` through ``aten._weight_int8pack_mm``.

    x: [..., K] float32 / bfloat16 / float16 (other floating dtypes run as float32). w_int8: int8 [N, K] contiguous.
    scales: [N], any float dtype; cast to the compute dtype if it differs (keep a copy in that dtype to avoid it).
    compute_dtype: the dtype the kernel runs in; default x's dtype. On x86 only ``torch.bfloat16`` is vectorized,
    so pass it for speed with float32 activations (x is cast in, y cast back; bf16 rounds x to ~3 digits).
    Returns [..., N] in x's dtype.
    """
    dtype = _compute_dtype(x, compute_dtype)
    if w_int8.dtype != torch.int8 or w_int8.dim() != 2:
        raise InputError(f"w_int8 must be a 2-D int8 tensor, got {w_int8.dtype} {tuple(w_int8.shape)}",
                         "quantize with quantize_int8_per_channel()")
    n, k = w_int8.shape
    if x.shape[-1] != k:
        raise InputError(f"x has {x.shape[-1]} features but w_int8 has in_features {k}")
    if scales.numel() != n:
        raise InputError(f"scales must have one value per output channel ({n}), got shape {tuple(scales.shape)}")
    x2 = _as_2d(x, dtype)
    if not w_int8.is_contiguous():
        w_int8 = w_int8.contiguous()
    if dtype == torch.bfloat16:
        # the vectorized kernel has no K tail and uses aligned loads (see the module docstring)
        if k % INT8_BF16_K_MULTIPLE:
            raise InputError(f"int8 with bfloat16 activations needs in_features % {INT8_BF16_K_MULTIPLE} == 0, "
                             f"got {k} (the kernel would read out of bounds)",
                             "pad in_features with zero columns, or run with compute_dtype=torch.float32")
        if w_int8.data_ptr() % _ALIGN:
            raise InputError("int8 weight for bfloat16 activations must start 64-byte aligned",
                             "store w_int8.clone() (a fresh allocation is aligned) instead of a view")
        if x2.data_ptr() % _ALIGN:
            x2 = x2.clone()
    scales = _in_dtype(scales if scales.dim() == 1 else scales.reshape(n), dtype)
    y = torch.ops.aten._weight_int8pack_mm(x2, w_int8, scales)
    return _finish(y, x, bias)


# --------------------------------------------------------------------------------------------------- int4


def check_int4_shape(out_features: int, in_features: int, group_size: int) -> None:
    """Raise InputError unless the int4 CPU kernel supports this [out, in] weight with this group size."""
    if group_size not in INT4_GROUP_SIZES:
        raise InputError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}",
                         "pick a supported group size")
    if in_features % group_size:
        ok = [g for g in INT4_GROUP_SIZES if in_features % g == 0]
        raise InputError(f"int4 in_features {in_features} is not divisible by group_size {group_size}",
                         f"use one of {ok}" if ok else "pad in_features to a multiple of 32")
    if out_features % INT4_N_MULTIPLE:
        raise InputError(f"int4 out_features {out_features} is not divisible by {INT4_N_MULTIPLE}",
                         "pad the output channels to a multiple of 16, or keep this layer in int8 / float")


def quantize_int4_groupwise(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric min/max int4 per group of ``group_size`` input columns (gpt-fast's recipe).

    Returns (codes uint8 [N,K] in 0..15, scales fp32 [N, K/group_size], zeros fp32 [N, K/group_size]) in the kernel's
    convention ``w ~= (codes - 8) * scale + zero`` (zero = min + 8 * scale). A reference helper for tests/benchmarks.
    """
    n, k = weight.shape
    check_int4_shape(n, k, group_size)
    w = weight.float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((hi - lo) / 15).clamp(min=1e-6)
    codes = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
    return codes, scales, lo + 8 * scales


def int4_zeros_from_zero_point(scales: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """Convert an integer-style zero point (``w = (q - zp) * scale``, as in GPTQ/AWQ checkpoints) to the kernel's
    float offset: ``zero = (8 - zp) * scale``."""
    return (8 - zero_point.float()) * scales.float()


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 weight the int4 kernel multiplies by: ``(codes - 8) * scale + zero`` per group."""
    n, k = codes.shape
    q = codes.float().reshape(n, k // group_size, group_size)
    return ((q - 8) * scales.float()[..., None] + zeros.float()[..., None]).reshape(n, k)


def prepare_int4_weight(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                        dtype: torch.dtype = FAST_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack int4 codes and their group parameters for :func:`int4_weight_linear`.

    codes: [N, K] integer tensor with values in 0..15 (uint8 / int32 / ...). scales, zeros: [N, K/group_size], the
    kernel's convention ``w = (codes - 8) * scale + zero`` (see :func:`int4_zeros_from_zero_point` for integer zero
    points). dtype: the activation dtype the layer will run in; scales_and_zeros is stored in it because the kernel
    demands equality (bfloat16 by default, the fast path; bf16 keeps ~3 significant digits of scale and zero).

    Returns (packed uint8 [N, K/2] in this CPU's layout, scales_and_zeros [K/group_size, N, 2] in ``dtype``).
    """
    if codes.dim() != 2:
        raise InputError(f"int4 codes must be 2-D [out, in], got shape {tuple(codes.shape)}")
    if codes.is_floating_point() or codes.is_complex():
        raise InputError(f"int4 codes must be an integer tensor, got {codes.dtype}")
    n, k = codes.shape
    check_int4_shape(n, k, group_size)
    n_groups = k // group_size
    if scales.shape != (n, n_groups) or zeros.shape != (n, n_groups):
        raise InputError(f"scales and zeros must be [{n}, {n_groups}] ([out, in/group_size]), got "
                         f"{tuple(scales.shape)} and {tuple(zeros.shape)}")
    if dtype not in KERNEL_DTYPES:
        raise InputError(f"dtype {dtype} is not one the int4 kernel accepts", "use float32, bfloat16 or float16")
    lo, hi = int(codes.min()), int(codes.max())
    if lo < 0 or hi > 15:
        raise InputError(f"int4 codes must lie in 0..15, found {lo}..{hi}",
                         "codes are unsigned; symmetric signed codes s map to s + 8 with zero = 0")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    scales_and_zeros = torch.stack([scales.float(), zeros.float()], dim=-1).transpose(0, 1).to(dtype).contiguous()
    return packed, scales_and_zeros


def int4_weight_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                       bias: torch.Tensor | None = None, *, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``y = x @ W.T (+ bias)`` with W the int4 group-quantized weight, through ``aten._weight_int4pack_mm_for_cpu``.

    x: [..., K] float32 / bfloat16 / float16 (other floating dtypes run as float32). packed, scales_and_zeros: from
    :func:`prepare_int4_weight` on this machine. compute_dtype: the kernel's dtype, default the dtype
    scales_and_zeros was prepared in (bfloat16 unless chosen otherwise), since that is the fast path on x86; x is
    cast in and y cast back. scales_and_zeros is cast if it differs (a pass over it each call: prepare it in the
    dtype you run). Returns [..., N] in x's dtype.
    """
    dtype = _compute_dtype(x, compute_dtype or scales_and_zeros.dtype)
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise InputError(f"packed must be the 2-D uint8 tensor prepare_int4_weight() returns, got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if x.shape[-1] != k:
        raise InputError(f"x has {x.shape[-1]} features but the packed weight has in_features {k}")
    check_int4_shape(n, k, group_size)
    if scales_and_zeros.shape != (k // group_size, n, 2):
        raise InputError(f"scales_and_zeros must be [{k // group_size}, {n}, 2] for group_size {group_size}, "
                         f"got {tuple(scales_and_zeros.shape)}")
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(_as_2d(x, dtype), packed, group_size,
                                                   _in_dtype(scales_and_zeros, dtype))
    return _finish(y, x, bias)
