"""The low-bit x int8 VNNI kernel (toolkit/quant/vnni.py): the v16 layout packs and unpacks 4- and 8-bit codes
exactly, tiles of fewer than four blocks included; the kernel computes what its torch reference computes (int8
activations per group, exact integer sums) within fp32 rounding, and stays within the activations' rounding of the
float product; a row's result does not depend on the rows beside it; an n8 pack converts to the same v16 pack."""

import pytest
import torch

from toolkit.quant import int4_native, vnni
from toolkit.quant.primitives import QuantConfig
from toolkit.quant.rtn import rtn_quantize

needs_kernel = pytest.mark.skipif(not vnni.available(), reason="the int8-activation kernel needs AVX2 and a C compiler")


def _needs(bits):
    if not vnni.available(bits):
        pytest.skip("8-bit codes need AVX512-VNNI (AVX2's 16-bit pair sums would saturate)")

SHAPES = [(960, 576, 64), (80, 64, 64), (48, 40, 16), (16, 8, 8), (64, 576, 128), (112, 96, 32)]


def _weights(n, k, group, bits, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_groups = -(-k // group)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, n_groups, generator=g) * 0.01 + 1e-3
    zero = torch.randint(0, 2 ** bits, (n, n_groups), generator=g, dtype=torch.uint8)
    return codes, scale, zero


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_pack_then_unpack_is_exact(n, k, group, bits):
    codes, scale, zero = _weights(n, k, group, bits)
    packed = vnni.pack(codes, scale, zero, group, bits)
    assert packed[0].numel() == n * k * bits // 8  # no padding: a last tile of 1-3 blocks is stored as it is
    back = vnni.unpack(*packed, bits=bits)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scale) and torch.equal(back[2], zero)


def test_pack_refuses_shapes_the_layout_cannot_hold():
    with pytest.raises(ValueError, match="out % 16"):
        vnni.pack(*_weights(24, 64, 32, 4), 32)
    with pytest.raises(ValueError, match="4- or 8-bit"):
        vnni.pack(*_weights(16, 64, 32, 4), 32, bits=3)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_kernel_is_its_reference_and_rows_are_independent(n, k, group, bits):
    _needs(bits)
    codes, scale, zero = _weights(n, k, group, bits, seed=1)
    bias = torch.randn(n)
    x = torch.randn(7, k)
    x[3] = 0.0  # an all-zero row (scale 0) gives the bias
    packed = vnni.pack(codes, scale, zero, group, bits)
    y = vnni.linear(x, *packed, group, bias, bits)
    ref = vnni.reference(x, codes, scale, zero, group, bias)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(y[3], bias)
    alone = torch.cat([vnni.linear(x[i:i + 1], *packed, group, bias, bits) for i in range(7)])
    assert torch.equal(y, alone)


@needs_kernel
@pytest.mark.parametrize("bits,group", [(4, 64), (8, -1)])
def test_the_module_is_the_float_product_up_to_the_activations_rounding(bits, group):
    _needs(bits)
    torch.manual_seed(0)
    weight = torch.randn(256, 192) * 0.05
    qw = rtn_quantize(weight, QuantConfig(bits=bits, group_size=group, symmetric=bits == 8))
    layer = vnni.VnniLinear.from_quantized(qw, act_group=64)
    assert layer.group_size == 64 and layer.bits == bits
    x = torch.randn(5, 192)
    exact = x @ qw.dequantize().t()
    err = (layer(x) - exact).norm() / exact.norm()
    assert 0 < err < 0.02  # int8 activations in groups of 64: ~0.5% here; never bit-exact
    assert torch.equal(layer(x[None]).squeeze(0), layer(x))


@needs_kernel
def test_an_n8_pack_converts_to_the_same_v16_pack():
    codes, scale, zero = _weights(96, 128, 32, 4, seed=2)
    n8 = int4_native.pack(codes, scale, zero, 32)
    converted = vnni.from_n8(*n8, 32)
    direct = vnni.pack(codes, scale, zero, 32)
    assert all(torch.equal(a, b) for a, b in zip(converted, direct))
    assert vnni.from_n8(*int4_native.pack(*_weights(8, 128, 32, 4), 32), 32) is None  # 8 outputs: no v16 block
