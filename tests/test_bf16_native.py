"""specquant's bf16 dot-product GEMM (toolkit/quant/bf16_native.py): the b16 pack holds the weight rounded to bf16
and reads back exactly; the product equals the bf16-rounded operands' product within fp32 summation rounding; a
row's result does not depend on the rows beside it (bit for bit); bad shapes are refused; engine.native_dot is
checked."""

import pytest
import torch

from toolkit.errors import InputError
from toolkit.quant import bf16_native

pytestmark = pytest.mark.skipif(not bf16_native.available(),
                                reason="the bf16 kernel needs AVX512-BF16 and a C compiler")


@pytest.mark.parametrize("n,k", [(16, 32), (208, 576), (64, 1536), (96, 64)])  # 208, 96: a last tile of 1 or 2 blocks
def test_pack_reads_back_the_bf16_weight(n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    packed = bf16_native.pack(w)
    assert packed.dtype == torch.bfloat16 and packed.numel() == n * k
    assert torch.equal(bf16_native.unpack(packed, n, k), w.to(torch.bfloat16))


@pytest.mark.parametrize("n,k,rows", [(208, 576, 1), (208, 576, 7), (64, 1536, 13), (96, 64, 6)])
def test_product_is_the_bf16_operands_product(n, k, rows):
    generator = torch.Generator().manual_seed(rows)
    w, x, bias = (torch.randn(n, k, generator=generator), torch.randn(rows, k, generator=generator),
                  torch.randn(n, generator=generator))
    y = bf16_native.linear(x, bf16_native.pack(w), n, bias)
    exact = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T + bias.double()
    scale = x.to(torch.bfloat16).double().abs() @ w.to(torch.bfloat16).double().abs().T  # sum of |terms|
    assert ((y.double() - exact).abs() <= 1e-6 * scale + 1e-6).all()
    loose = x @ w.T + bias  # and not the fp32 product: the operands were rounded
    assert not torch.allclose(y, loose, atol=1e-5)


def test_rows_are_independent():
    generator = torch.Generator().manual_seed(0)
    w, x = torch.randn(208, 576, generator=generator), torch.randn(13, 576, generator=generator)
    packed = bf16_native.pack(w)
    together = bf16_native.linear(x, packed, 208)
    apart = torch.cat([bf16_native.linear(x[i:i + 1], packed, 208) for i in range(13)])
    assert torch.equal(together, apart)


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
    assert model.specquant_precision.dot == "bf16" and "bf16 native products" in model.specquant_precision.name
    assert model.forward.native_decoder().head_kernel is bf16_native
    down = model.model.layers[0].mlp.down_proj  # the fp16 kernel's pack of the same weight is dropped, not kept
    assert hasattr(down, "specquant_b16") and not hasattr(down, "specquant_h16")
