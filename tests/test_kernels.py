"""The int8 / int4 CPU kernel wrappers against a float reference: dequantize the same codes, then F.linear in float64.

Tolerances (max |y - ref| / max |ref| over the output):
* float32 activations: 1e-5 (fp32 accumulation over K <= 1536; observed ~1e-6).
* bfloat16: 1.5e-2 (x rounded to bf16 by the caller, output stored in bf16: 2^-8 relative, plus accumulation;
  observed ~3-6e-3). The int4 reference uses scales/zeros rounded to bf16 as the kernel sees them.
* float16: 3e-3 (output stored in fp16: 2^-11 relative; observed ~4e-4).
"""

import pytest
import torch
import torch.nn.functional as F

from toolkit.errors import InputError
from toolkit.quant.kernels import (
    INT4_GROUP_SIZES,
    dequantize_int4,
    dequantize_int8,
    int4_weight_linear,
    int4_zeros_from_zero_point,
    int8_weight_linear,
    prepare_int4_weight,
    quantize_int4_groupwise,
    quantize_int8_per_channel,
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 3e-3}
DTYPES = list(TOL)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def reference(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """F.linear in float64 on x rounded to the compute dtype, as the kernel sees it."""
    return F.linear(x.to(dtype).double(), w.double())


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ------------------------------------------------------------------------------------------------------- int8


INT8_CASES = [(96, 576, dt) for dt in DTYPES] + [(7, 104, torch.bfloat16)]  # bf16: K % 8 on AVX2 (we ask % 16)
INT8_CASES += [(7, 100, dt) for dt in (torch.float32, torch.float16)]  # scalar paths take any K


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("n,k,dtype", INT8_CASES)
def test_int8_matches_dequantized_reference(n, k, dtype, rows):
    shape = (n, k)
    if dtype == torch.bfloat16 and k % 16 and torch.backends.cpu.get_cpu_capability() != "AVX2":
        pytest.skip("bf16 int8 with K % 16 != 0 is only safe on AVX2 (K % 8 == 0 there)")
    w_int8, scales = quantize_int8_per_channel(torch.randn(*shape))
    x = torch.randn(rows, shape[1])
    if dtype == torch.bfloat16 and k % 16:
        y = torch.ops.aten._weight_int8pack_mm(x.to(dtype), w_int8, scales.to(dtype))
    else:
        y = int8_weight_linear(x.to(dtype), w_int8, scales.to(dtype))
    assert y.dtype == dtype and y.shape == (rows, shape[0])
    w_ref = dequantize_int8(w_int8, scales.to(dtype))  # the scales as the kernel sees them
    assert rel_err(y, reference(x, w_ref, dtype)) < TOL[dtype]


def test_int8_compute_dtype_casts_in_and_out_and_keeps_leading_dims():
    w_int8, scales = quantize_int8_per_channel(torch.randn(64, 128))
    bias = torch.randn(64)
    x = torch.randn(2, 3, 128)
    y = int8_weight_linear(x, w_int8, scales, bias, compute_dtype=torch.bfloat16)
    assert y.dtype == torch.float32 and y.shape == (2, 3, 64)
    ref = reference(x, dequantize_int8(w_int8, scales.bfloat16()), torch.bfloat16) + bias.double()
    assert rel_err(y, ref) < TOL[torch.bfloat16]


def test_int8_kernel_dtype_rules():
    """The raw kernel wants scales in exactly the activation dtype and a 2-D activation; the wrapper handles both."""
    w_int8, scales = quantize_int8_per_channel(torch.randn(32, 64))
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="expected scalar type"):
        torch.ops.aten._weight_int8pack_mm(x.bfloat16(), w_int8, scales)
    with pytest.raises(RuntimeError, match="2D"):
        torch.ops.aten._weight_int8pack_mm(x[None], w_int8, scales)
    y = int8_weight_linear(x.bfloat16(), w_int8, scales)  # fp32 scales cast to bf16
    assert y.dtype == torch.bfloat16
    with pytest.raises(InputError):
        int8_weight_linear(x, w_int8.to(torch.uint8), scales)
    with pytest.raises(InputError):
        int8_weight_linear(x, w_int8, scales[:-1])


def test_int8_bf16_refuses_unsafe_widths_and_realigns_activations():
    """The bf16 int8 kernel has no K tail and uses aligned loads: K % 8 != 0 crashes it at M > 1 (segfault, not
    reproduced here), a misaligned activation too. The wrapper refuses K % 16 != 0 and copies misaligned input."""
    w_int8, scales = quantize_int8_per_channel(torch.randn(8, 100))
    with pytest.raises(InputError, match="in_features % 16"):
        int8_weight_linear(torch.randn(16, 100), w_int8, scales, compute_dtype=torch.bfloat16)
    y = int8_weight_linear(torch.randn(16, 100), w_int8, scales)  # float32: any K
    assert y.shape == (16, 8)

    w_int8, scales = quantize_int8_per_channel(torch.randn(8, 96))
    big = torch.randn(4 * 96 + 8).bfloat16()
    x = big[2:2 + 4 * 96].view(4, 96)  # contiguous, but 4 bytes past a 64-byte boundary
    assert x.data_ptr() % 16
    y = int8_weight_linear(x, w_int8, scales)
    ref = reference(x.float(), dequantize_int8(w_int8, scales.bfloat16()), torch.bfloat16)
    assert rel_err(y, ref) < TOL[torch.bfloat16]
    with pytest.raises(InputError, match="aligned"):
        int8_weight_linear(x, torch.zeros(9, 96, dtype=torch.int8)[1:], scales)


# ------------------------------------------------------------------------------------------------------- int4


INT4_CASES = [(96, 768, g) for g in (32, 64, 128)] + [(48, 576, 32), (48, 576, 64), (32, 512, 256)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("n,k,group_size", INT4_CASES)
def test_int4_matches_dequantized_reference(n, k, group_size, rows, dtype):
    codes, scales, zeros = quantize_int4_groupwise(torch.randn(n, k), group_size)
    packed, scales_and_zeros = prepare_int4_weight(codes, scales, zeros, group_size, dtype=dtype)
    assert packed.dtype == torch.uint8 and packed.shape == (n, k // 2)
    assert scales_and_zeros.shape == (k // group_size, n, 2) and scales_and_zeros.dtype == dtype
    x = torch.randn(rows, k)
    y = int4_weight_linear(x.to(dtype), packed, scales_and_zeros, group_size)
    assert y.dtype == dtype and y.shape == (rows, n)
    # the reference sees the scales and zeros rounded to the dtype they were stored in, as the kernel does
    w_ref = dequantize_int4(codes, scales.to(dtype), zeros.to(dtype), group_size)
    assert rel_err(y, reference(x, w_ref, dtype)) < TOL[dtype]


def test_int4_zero_is_a_float_offset_around_code_8():
    """Pin the convention by construction: w = (q - 8) * scale + zero, zero a float (not an integer zero point)."""
    n, k, g = 16, 64, 32
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = torch.rand(n, k // g) + 0.5
    zeros = torch.randn(n, k // g)
    packed, sz = prepare_int4_weight(codes, scales, zeros, g, dtype=torch.float32)
    eye = torch.eye(k)
    w_seen = int4_weight_linear(eye, packed, sz, g).T  # x = I gives I @ W.T = W.T
    expected = (codes.float() - 8).reshape(n, k // g, g) * scales[..., None] + zeros[..., None]
    torch.testing.assert_close(w_seen, expected.reshape(n, k), rtol=1e-6, atol=1e-6)


def test_int4_integer_zero_point_conversion():
    n, k, g = 32, 128, 64
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = torch.rand(n, k // g) + 0.1
    zero_point = torch.randint(0, 16, (n, k // g))
    w_int_zp = (codes.float().reshape(n, k // g, g) - zero_point[..., None]) * scales[..., None]
    zeros = int4_zeros_from_zero_point(scales, zero_point)
    torch.testing.assert_close(dequantize_int4(codes, scales, zeros, g), w_int_zp.reshape(n, k))


def test_int4_quantizer_error_is_within_half_a_step():
    w = torch.randn(64, 256)
    codes, scales, zeros = quantize_int4_groupwise(w, 64)
    err = (dequantize_int4(codes, scales, zeros, 64) - w).abs().reshape(64, 4, 64)
    assert (err <= scales[..., None] / 2 + 1e-6).all()


def test_int4_fp32_activations_run_bf16_by_default_and_keep_dtype():
    codes, scales, zeros = quantize_int4_groupwise(torch.randn(64, 256), 64)
    packed, sz = prepare_int4_weight(codes, scales, zeros, 64)  # default: bf16, the vectorized path
    x = torch.randn(2, 5, 256)
    y = int4_weight_linear(x, packed, sz, 64, bias=torch.ones(64))
    assert y.dtype == torch.float32 and y.shape == (2, 5, 64)
    ref = reference(x, dequantize_int4(codes, scales.bfloat16(), zeros.bfloat16(), 64), torch.bfloat16) + 1
    assert rel_err(y.reshape(10, 64), ref.reshape(10, 64)) < TOL[torch.bfloat16]


def test_int4_inner_k_tiles_is_ignored_on_cpu():
    codes = torch.randint(0, 16, (32, 256), dtype=torch.int32)
    packs = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, t) for t in (1, 2, 4, 8)]
    assert all(torch.equal(packs[0], p) for p in packs[1:])


def test_int4_constraints_raise():
    """What the int4 CPU kernel refuses, raw (RuntimeError) and through the wrappers (InputError, checked first)."""
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu

    # SmolLM2's width 576 with group 128: 576 % 128 != 0
    codes = torch.randint(0, 16, (64, 576), dtype=torch.int32)
    packed = pack(codes, 1)
    with pytest.raises(RuntimeError, match="divisible by qGroupSize"):
        mm(torch.randn(1, 576), packed, 128, torch.rand(576 // 128 + 1, 64, 2))
    with pytest.raises(InputError, match="not divisible by group_size 128"):
        prepare_int4_weight(codes, torch.rand(64, 4), torch.rand(64, 4), 128)
    # group sizes other than 32/64/128/256
    with pytest.raises(RuntimeError, match="qGroupSize to be 32, 64, 128 or 256"):
        mm(torch.randn(1, 576), packed, 16, torch.rand(576 // 16, 64, 2))
    for g in (16, 512, 576):
        with pytest.raises(InputError, match="group_size must be one of"):
            prepare_int4_weight(codes, torch.rand(64, 1), torch.rand(64, 1), g)
    # out_features not a multiple of 16
    with pytest.raises(RuntimeError, match="dividable by 16"):
        pack(torch.randint(0, 16, (100, 256), dtype=torch.int32), 1)
    with pytest.raises(InputError, match="out_features 100"):
        prepare_int4_weight(torch.randint(0, 16, (100, 256)), torch.rand(100, 4), torch.rand(100, 4), 64)
    # codes must be int32 for the packer (the wrapper converts), and within 0..15 (the wrapper checks)
    with pytest.raises(RuntimeError, match="kInt"):
        pack(codes.to(torch.uint8), 1)
    with pytest.raises(InputError, match="0..15"):
        prepare_int4_weight(codes + 1, torch.rand(64, 18), torch.rand(64, 18), 32)
    # scales_and_zeros must match the activation dtype exactly (the wrapper casts) and be [K/g, N, 2]
    packed, sz = prepare_int4_weight(codes, torch.rand(64, 18), torch.rand(64, 18), 32, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="expected scalar type"):
        mm(torch.randn(1, 576).bfloat16(), packed, 32, sz)
    assert int4_weight_linear(torch.randn(1, 576), packed, sz, 32, compute_dtype=torch.bfloat16).dtype == torch.float32
    with pytest.raises(InputError, match="scales_and_zeros must be"):
        int4_weight_linear(torch.randn(1, 576), packed, sz.transpose(0, 1), 32)
    assert set(INT4_GROUP_SIZES) == {32, 64, 128, 256}
