"""specquant's fp16-weight GEMM (toolkit/quant/half_native.py): the fp16 weight's exact product with fp32
activations within fp32 rounding, bias included, rows independent bit for bit, the layout's constraint a clear
error."""

import pytest
import torch

from toolkit import cpu
from toolkit.quant import half_native

pytestmark = pytest.mark.skipif(not half_native.available(), reason="the fp16 GEMM kernel needs a C compiler and "
                                                                    "AVX2 + F16C")


@pytest.mark.parametrize("n,k", [(16, 8), (48, 40), (80, 576), (960, 576)])  # 80 and 48: a last tile of 1 and 3
def test_the_product_is_the_fp16_weights_within_fp32_rounding(n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) * 0.1).half()
    bias = torch.randn(n, generator=gen)
    packed = half_native.pack(w)
    assert packed.dtype == torch.float16 and packed.numel() == n * k
    for m in (1, 2, 3, 4, 5, 7, 9):
        x = torch.randn(m, k, generator=gen)
        ref = x.double() @ w.double().T + bias.double()
        got = half_native.linear(x, packed, n, bias)
        assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
        alone = torch.cat([half_native.linear(x[i:i + 1], packed, n, bias) for i in range(m)])
        assert torch.equal(got, alone)  # a row's result does not depend on the rows beside it
    assert torch.equal(half_native.linear(x, packed, n), half_native.linear(x, packed, n, torch.zeros(n)))


def test_a_width_the_layout_cannot_hold_is_a_clear_error():
    with pytest.raises(ValueError, match="N % 16"):
        half_native.pack(torch.zeros(24, 8, dtype=torch.float16))


def test_the_avx2_build_gives_the_avx512_builds_bits():
    """The AVX2 build (8-wide registers, up to 3 rows a pass) sums each output in the AVX512 build's order (bias,
    then one FMA per input column), so a float model gives the same products on either CPU."""
    if not cpu.has("avx512f"):
        pytest.skip("this CPU (or SPECQUANT_ISA) has no AVX512F: only the AVX2 build runs here")
    avx2 = half_native.load(tuple(cpu.with_level(half_native.FLAGS, "avx2")))
    assert avx2 is not None
    g = torch.Generator().manual_seed(2)
    n, k = 208, 96  # 3 whole tiles and a last tile of 1 block
    w, bias = (torch.randn(n, k, generator=g) * 0.1).half(), torch.randn(n, generator=g)
    packed = half_native.pack(w)
    for m in (1, 2, 3, 5, 8):
        x = torch.randn(m, k, generator=g)
        y = torch.empty(m, n)
        assert avx2.sq_f16_linear(x.data_ptr(), m, k, packed.data_ptr(), bias.data_ptr(), n, y.data_ptr()) == 0
        assert torch.equal(y, half_native.linear(x, packed, n, bias))
