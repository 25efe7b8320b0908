"""engine.native_dot=int8 (docs/engine.md, "Precision"): an int4 model's native stack with each row's activations
rounded to int8 per weight group, an int8 model's per 128 or 64 columns (toolkit/quant/vnni.py). Every product runs the w4a8
(w8a8: AVX512-VNNI only) kernel; its logits are close to
the exact stack's but not equal; greedy speculative output at that setting is the same target's greedy output alone
(rows stay independent); evaluation measures the same arithmetic generation runs; a model it cannot run is a clear
error naming the fix."""

import pytest
import torch

from toolkit.engine import generate
from toolkit.engine.lean_forward import install
from toolkit.engine.native_decoder import library
from toolkit.engine.precision import Precision, prepare_model
from toolkit.engine.setup import use_native_dot
from toolkit.errors import InputError
from toolkit.kv import KVSpec
from toolkit.model_state import peek, state_of
from toolkit.quant import vnni

pytestmark = pytest.mark.skipif(library() is None or not vnni.available(),
                                reason="needs the native decoder and the int8-activation kernel (AVX2)")


def _float_model(tokenizer):
    """A float Llama with SmolLM2's head width (64) and widths the v16 layout holds, engine-prepared."""
    from conftest import small_llama

    model = small_llama(tokenizer, intermediate=512, positions=512)
    prepare_model(model, Precision(torch.float32, torch.float16), gemm="fbgemm")
    install(model)
    return model


@pytest.fixture(params=[4, 8], ids=["int4", "int8"])
def quant_model(request, tiny_tokenizer):
    """An int4 (g32) or int8 (per channel) model on specquant's kernels, as a checkpoint loads."""
    from toolkit.spec.self_draft import build_self_draft

    if request.param == 8 and not vnni.available(bits=8):
        pytest.skip("int8 weights x int8 activations need AVX512-VNNI")
    model = build_self_draft(_float_model(tiny_tokenizer), bits=request.param,
                             group_size=32 if request.param == 4 else -1)
    model.specquant_test_bits = request.param
    state_of(model).precision = Precision(torch.float32, torch.float16)
    assert model.forward.native_decoder() is not None
    return model


def _prompts():
    import pydoc_data.topics

    texts = [t for t in pydoc_data.topics.topics.values() if len(t) > 400]
    return [texts[5 * i][:60 + 11 * i] + " " + texts[5 * i][:30] for i in range(4)]


def test_every_product_runs_int8_activations_close_to_the_exact_stack(quant_model, tiny_tokenizer):
    ids = tiny_tokenizer(_prompts()[0], return_tensors="pt").input_ids
    with torch.inference_mode():
        exact = quant_model(input_ids=ids, use_cache=False).logits
    use_native_dot(quant_model, "int8")
    native = quant_model.forward.native_decoder()
    assert native.w4a8 == len(native.kinds) == 4 * quant_model.config.num_hidden_layers
    precision = peek(quant_model).precision
    assert precision.dot == "int8" and "int8" in precision.name
    assert f"int{quant_model.specquant_test_bits} x int8" in next(iter(native.describe()["products"]))
    from toolkit.evaluation.forward import window_logits

    approx = window_logits(quant_model, ids)
    assert approx.shape == exact.shape and not torch.equal(approx, exact)
    assert (approx - exact).abs().max() <= 0.1 * exact.abs().max()
    # the evaluation's logits are the stack's: a prompt fed in two calls through one cache gives the same rows
    from toolkit.engine import ContiguousKVCache

    cache = ContiguousKVCache.for_model(quant_model, ids.shape[1])
    half = ids.shape[1] // 2
    with torch.inference_mode():
        parts = [quant_model(input_ids=ids[:, :half], cache=cache, use_cache=True).logits,
                 quant_model(input_ids=ids[:, half:], position_ids=torch.arange(half, ids.shape[1])[None],
                            cache=cache, use_cache=True).logits]
    assert torch.equal(torch.cat(parts, dim=1), approx)
    # a quantized cache is evaluated on the stack too, fed a few tokens a call so later ones read earlier ones back
    from toolkit.kv.config import KVQuantConfig

    kv = KVSpec("int8", KVQuantConfig(bits=8, group_size=16, residual=8))
    quantized = window_logits(quant_model, ids, kv, chunk=4)
    assert not torch.equal(quantized, approx)
    assert (quantized - approx).abs().max() <= 0.1 * approx.abs().max()


def test_speculative_greedy_output_at_int8_is_the_target_alone(quant_model, tiny_tokenizer):
    from toolkit.spec.decode import DraftLength, speculative_generate
    from toolkit.spec.drafts import LookupDraft

    use_native_dot(quant_model, "int8")
    for i, prompt in enumerate(_prompts()):
        alone = generate(quant_model, tiny_tokenizer, [prompt], 24, stop_tokens=set()).sequences[0].token_ids
        out = speculative_generate(quant_model, tiny_tokenizer, [prompt], 24, LookupDraft(3, 1),
                                   DraftLength(k=2 + i, adaptive=i % 2 == 1, k_min=1, k_max=6), stop_tokens=set())
        assert out.sequences[0].token_ids == alone, i


def test_a_model_it_cannot_run_is_a_clear_error(tiny_tokenizer):
    model = _float_model(tiny_tokenizer)
    state_of(model).precision = Precision(torch.float32, torch.float16)
    with pytest.raises(InputError, match="applies to int4 and int8 checkpoints") as error:
        use_native_dot(model, "int8")
    assert "engine.native_dot=fp32" in error.value.fix
    with pytest.raises(InputError, match="unknown engine.native_dot 'int4'"):
        use_native_dot(model, "int4")


def test_evaluation_at_int8_runs_perplexity_only(quant_model, tiny_tokenizer):
    from toolkit.evaluation.suite import Settings, run_tasks

    use_native_dot(quant_model, "int8")
    for task in ("cloze", "mc", "gen"):
        with pytest.raises(InputError, match="task=ppl"):
            run_tasks(quant_model, tiny_tokenizer, _prompts(), ["ppl", task], Settings())


def test_an_int8_model_without_vnni_is_a_clear_error(tiny_tokenizer, monkeypatch):
    """int8 weights x int8 activations need AVX512-VNNI (AVX2's pair sums would saturate): elsewhere the setting is
    refused with the fix, and the model keeps its exact stack."""
    from toolkit.engine import native_decoder
    from toolkit.spec.self_draft import build_self_draft

    model = build_self_draft(_float_model(tiny_tokenizer), bits=8, group_size=-1)
    state_of(model).precision = Precision(torch.float32, torch.float16)
    monkeypatch.setattr(native_decoder.vnni, "available", lambda bits=4: bits == 4)
    with pytest.raises(InputError, match="AVX512-VNNI") as error:
        use_native_dot(model, "int8")
    assert "engine.native_dot=fp32" in error.value.fix
    native = model.forward.native_decoder()
    assert native is not None and native.w4a8 == 0 and peek(model).precision.dot == "fp32"
