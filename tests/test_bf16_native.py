"""specquant's bf16 dot-product GEMM (toolkit/quant/bf16_native.py): the b16 pack holds the weight rounded to bf16
and reads back exactly; the product equals the bf16-rounded operands' product within fp32 summation rounding; a
row's result does not depend on the rows beside it (bit for bit); both hold on vdpbf16ps and on the AMX tile unit
(where the CPU has it; skipped, visibly, elsewhere); the switch between them reaches the native decoder's copy of
the kernel; bad shapes are refused; engine.native_dot is checked."""

import pytest
import torch

from toolkit.errors import InputError
from toolkit.model_state import peek
from toolkit.quant import bf16_native

pytestmark = pytest.mark.skipif(not bf16_native.available(),
                                reason="the bf16 kernel needs AVX512-BF16 and a C compiler")


def _has_amx() -> bool:
    if not bf16_native.available():
        return False
    on = bf16_native.amx_in_use()
    try:
        return bf16_native.set_amx(True)
    finally:
        bf16_native.set_amx(on)


PATHS = ["vdpbf16ps", pytest.param("amx", marks=pytest.mark.skipif(not _has_amx(), reason="the CPU has no AMX-BF16"))]


@pytest.fixture(params=PATHS)
def path(request):
    """Each test below on each path the bf16 kernel can take here; the path in force before is put back."""
    before = bf16_native.amx_in_use()
    assert bf16_native.set_amx(request.param == "amx") == (request.param == "amx")
    yield request.param
    bf16_native.set_amx(before)


@pytest.mark.parametrize("n,k", [(16, 32), (208, 576), (64, 1536), (96, 64)])  # 208, 96: a last tile of 1 or 2 blocks
def test_pack_reads_back_the_bf16_weight(n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    packed = bf16_native.pack(w)
    assert packed.dtype == torch.bfloat16 and packed.numel() == n * k
    assert torch.equal(bf16_native.unpack(packed, n, k), w.to(torch.bfloat16))


@pytest.mark.parametrize("n,k,rows", [(208, 576, 1), (208, 576, 7), (64, 1536, 13), (96, 64, 6), (208, 576, 37)])
def test_product_is_the_bf16_operands_product(n, k, rows, path):
    generator = torch.Generator().manual_seed(rows)
    w, x, bias = (torch.randn(n, k, generator=generator), torch.randn(rows, k, generator=generator),
                  torch.randn(n, generator=generator))
    y = bf16_native.linear(x, bf16_native.pack(w), n, bias)
    exact = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T + bias.double()
    scale = x.to(torch.bfloat16).double().abs() @ w.to(torch.bfloat16).double().abs().T  # sum of |terms|
    assert ((y.double() - exact).abs() <= 1e-6 * scale + 1e-6).all()
    loose = x @ w.T + bias  # and not the fp32 product: the operands were rounded
    assert not torch.allclose(y, loose, atol=1e-5)


def test_rows_are_independent(path):
    generator = torch.Generator().manual_seed(0)
    w, x = torch.randn(208, 576, generator=generator), torch.randn(37, 576, generator=generator)  # 37: 16 + 16 + 5
    packed = bf16_native.pack(w)
    together = bf16_native.linear(x, packed, 208)
    apart = torch.cat([bf16_native.linear(x[i:i + 1], packed, 208) for i in range(37)])
    assert torch.equal(together, apart)
    assert torch.equal(bf16_native.linear(x[3:9], packed, 208), together[3:9])


@pytest.mark.skipif(not _has_amx(), reason="the CPU has no AMX-BF16")
def test_the_amx_switch_reaches_every_library_and_changes_the_sums():
    from toolkit.engine import native_decoder

    decoder = native_decoder.library()
    before = bf16_native.amx_in_use()
    generator = torch.Generator().manual_seed(1)
    w, x = torch.randn(208, 576, generator=generator), torch.randn(5, 576, generator=generator)
    packed, y = bf16_native.pack(w), torch.empty(5, 208)
    try:
        sums = {}
        for on in (False, True):
            assert bf16_native.set_amx(on) == on and bf16_native.amx_in_use() == on
            assert decoder is None or decoder.sq_b16_amx(-1) == on  # the decoder's own copy of the kernel follows
            sums[on] = bf16_native.linear(x, packed, 208)
            if decoder is not None:  # and gives this module's sums, bit for bit
                assert decoder.sq_b16_linear(x.data_ptr(), 5, 576, packed.data_ptr(), None, 208, y.data_ptr()) == 0
                assert torch.equal(y, sums[on])
        # another order of additions inside a pair: some last bits differ (so the path is really switched)
        assert not torch.equal(sums[False], sums[True]) and torch.allclose(sums[False], sums[True], atol=1e-4)
    finally:
        bf16_native.set_amx(before)


@pytest.mark.skipif(not _has_amx(), reason="the CPU has no AMX-BF16")
def test_torch_bf16_matmuls_beside_the_tile_path_are_unchanged():
    """torch's bf16 matmul uses the tile unit too (oneDNN) with its own tile configuration: ours is loaded per call
    and released after it, so products interleaved with ours give what they give alone."""
    generator = torch.Generator().manual_seed(2)
    a, b = (torch.randn(96, 256, generator=generator).bfloat16(), torch.randn(256, 192, generator=generator).bfloat16())
    alone = a @ b
    w, x = torch.randn(208, 576, generator=generator), torch.randn(9, 576, generator=generator)
    packed, before = bf16_native.pack(w), bf16_native.amx_in_use()
    try:
        assert bf16_native.set_amx(True)
        ours = bf16_native.linear(x, packed, 208)
        for _ in range(3):
            assert torch.equal(a @ b, alone)
            assert torch.equal(bf16_native.linear(x, packed, 208), ours)
    finally:
        bf16_native.set_amx(before)


def test_bad_shapes_are_refused():
    assert not bf16_native.supports(208, 40) and not bf16_native.supports(20, 64)
    with pytest.raises(ValueError, match="K % 32"):
        bf16_native.pack(torch.randn(16, 40))
    with pytest.raises(ValueError, match="fp32 rows"):
        bf16_native.linear(torch.randn(2, 64, dtype=torch.float64), bf16_native.pack(torch.randn(16, 64)), 16)


def test_engine_native_dot_is_checked(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from toolkit.engine.lean_forward import install
    from toolkit.engine.precision import Precision, prepare_model
    from toolkit.engine.setup import use_native_dot

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with pytest.raises(InputError, match="unknown engine.native_dot 'fp8'"):
        use_native_dot(model, "fp8")
    install(model)  # fp32 layers, not prepared: the lean forward's torch path, no native stack
    with pytest.raises(InputError, match="needs the native decoder stack|cannot run this model"):
        use_native_dot(model, "bf16")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prepare_model(model, Precision(torch.float32, torch.float16), gemm="fbgemm")
    install(model)
    from toolkit.spec.self_draft import build_self_draft

    draft = build_self_draft(model, bits=4, group_size=32)  # low-bit layers: they keep their kernels, no error
    use_native_dot(draft, "bf16")
    assert draft.forward.native_dot == "fp32" and draft.forward.native_decoder().half == 0
    use_native_dot(model, "bf16")
    precision = peek(model).precision
    assert precision.dot == "bf16" and "bf16 native products" in precision.name
    assert model.forward.native_decoder().head_kernel is bf16_native
    down = model.model.layers[0].mlp.down_proj  # the fp16 kernel's pack of the same weight is dropped, not kept
    assert hasattr(down, "specquant_b16") and not hasattr(down, "specquant_h16")
