"""Interop with the GPTQ/AWQ ecosystem (optional `interop` extra: gptqmodel 7.6.0 + optimum 2.3.0, in its own
venv because gptqmodel pins numpy 2.2.6; see docs/formats.md). Skipped, with the reason, when gptqmodel is missing.

(a) transformers loads our GPTQ export, (b) our AWQ export, and its logits match ours; (c) a checkpoint that
gptqmodel itself quantized (on this CPU, desc_act and asymmetric) loads in specquant with matching logits.

How logits are compared. gptqmodel's CPU kernels (TorchAtenLinear / TorchAtenAwqLinear) run
``_weight_int4pack_mm_for_cpu`` with bf16 activations and bf16 scales, so their default path differs from any fp32
reference by bf16 rounding. Each test therefore checks two things:
1. layout, exactly: their modules forced onto their dequantize path (``linear_mode="train"``, fp32 activations)
   against our imported weights dequantized into a float copy of the model: max |diff| <= LAYOUT_TOL * max |logit|
   (float summation order and AWQ's fp16 dequantization arithmetic only; any packing error is O(1));
2. their default inference path against our QuantLinear: max |diff| <= KERNEL_TOL * max |logit| (bf16).
"""

import os

import pytest
import torch

pytestmark = pytest.mark.interop

gptqmodel = pytest.importorskip("gptqmodel", reason="interop extra not installed: gptqmodel 7.6.0 + optimum 2.3.0 "
                                "(see docs/formats.md, 'GPTQ/AWQ interop venv')")
pytest.importorskip("optimum", reason="interop extra not installed: optimum 2.3.0")
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

LAYOUT_TOL = 1e-2  # relative to max |logit|; measured 1.0e-3..2.2e-3 (fp16 dequantization), a packing error is O(1)
KERNEL_TOL = 5e-2  # measured 0..2.6e-2: bf16 activations and scales in gptqmodel's int4 CPU kernel
IDS = torch.tensor([[1, 17, 42, 99, 7, 256, 300, 12, 5, 64, 33, 2, 111, 45, 9, 400]])


def _ours(path, ids=IDS):
    """Logits of the directory imported by specquant: (QuantLinear engine path, dequantized float reference)."""
    import copy

    from torch import nn

    from toolkit.quant.formats import import_checkpoint
    from toolkit.quant.model_quant import swap_quantized_modules
    from toolkit.quant.qlinear import QuantLinear

    model, qsd, _ = import_checkpoint(path, dtype=torch.float32)
    float_model = copy.deepcopy(model)

    def dequantized(qw):
        linear = nn.Linear(qw.in_features, qw.out_features, bias=qw.bias is not None)
        with torch.no_grad():
            linear.weight.copy_(qw.dequantize())
            if qw.bias is not None:
                linear.bias.copy_(qw.bias)
        return linear

    swap_quantized_modules(float_model, qsd, dequantized)
    swap_quantized_modules(model, qsd, QuantLinear.from_quantized)
    with torch.no_grad():
        return model(ids).logits, float_model(ids).logits


def _theirs(path, force_dequant: bool, ids=IDS):
    """Logits of transformers.from_pretrained (gptqmodel kernels) on the directory, fp32 activations."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    qlinears = [m for m in model.modules() if type(m).__module__.startswith("gptqmodel.")
                and hasattr(m, "linear_mode")]
    assert qlinears, "transformers did not build gptqmodel quantized layers"
    if force_dequant:
        for m in qlinears:
            m.linear_mode = "train"  # their dequantize + matmul path in the activation dtype
    with torch.no_grad():
        return model(ids).logits.float()


def _rel_max(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _check(path, label, ids=IDS):
    engine, reference = _ours(path, ids)
    layout = _rel_max(_theirs(path, force_dequant=True, ids=ids), reference)
    kernel = _rel_max(_theirs(path, force_dequant=False, ids=ids), engine)
    print(f"{label}: max|diff|/max|logit| layout {layout:.2e}, kernel {kernel:.2e}")
    assert layout <= LAYOUT_TOL, f"{label}: packing disagrees ({layout:.3e})"
    assert kernel <= KERNEL_TOL, f"{label}: kernel logits disagree ({kernel:.3e})"
    return layout, kernel


def _export(tmp_path, tiny_llama_dir, fmt, **recipe):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.quant.checkpoint import save_quantized
    from toolkit.quant.formats import export_checkpoint
    from toolkit.quant.model_quant import QuantRecipe, quantize_model

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    qsd = quantize_model(model, QuantRecipe(**recipe), progress=False)
    ck = save_quantized(tmp_path / "ck", model, qsd, tokenizer=AutoTokenizer.from_pretrained(tiny_llama_dir))
    return export_checkpoint(ck, fmt, tmp_path / fmt)


def test_a_transformers_loads_our_gptq_export(tmp_path, tiny_llama_dir):
    _check(_export(tmp_path, tiny_llama_dir, "gptq", bits=4, group_size=32, symmetric=True), "gptq w4g32 sym")


def test_b_transformers_loads_our_awq_export(tmp_path, tiny_llama_dir):
    _check(_export(tmp_path, tiny_llama_dir, "awq", bits=4, group_size=32, symmetric=False), "awq w4g32 asym")


@pytest.fixture(scope="module")
def gptqmodel_checkpoint(tiny_llama_dir, tmp_path_factory):
    """gptqmodel quantizes the tiny llama on the CPU: act-order (desc_act) and asymmetric, GPTQ v1 on disk."""
    import pydoc_data.topics

    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    texts = list(pydoc_data.topics.topics.values())[:32]
    calibration = []
    for text in texts:
        ids = tok(text[:400]).input_ids
        calibration.append({"input_ids": ids, "attention_mask": [1] * len(ids)})
    config = QuantizeConfig(bits=4, group_size=32, desc_act=True, sym=False)
    model = GPTQModel.load(str(tiny_llama_dir), config, device="cpu")
    model.quantize(calibration, batch_size=4)
    out = tmp_path_factory.mktemp("gptqmodel") / "tiny-gptq"
    model.save(str(out))
    return out


def test_c_a_gptqmodel_checkpoint_loads_in_specquant(gptqmodel_checkpoint):
    from toolkit.quant.formats import detect_format, import_checkpoint

    assert detect_format(gptqmodel_checkpoint) == "gptq"
    _, qsd, _ = import_checkpoint(gptqmodel_checkpoint)
    assert len(qsd.weights) == 14
    assert any(qw.g_idx is not None for qw in qsd.weights.values())  # desc_act survived as g_idx
    assert not next(iter(qsd.weights.values())).config.symmetric
    _check(gptqmodel_checkpoint, "gptqmodel-made w4g32 desc_act asym")


@pytest.mark.real_model
@pytest.mark.parametrize("fmt,symmetric", [("gptq", True), ("awq", False)])
def test_d_smollm2_exports_load_in_transformers(fmt, symmetric, smollm2, tmp_path):
    """SmolLM2-135M RTN w4g64 exported and loaded by transformers + gptqmodel, 128 tokens of pydoc text."""
    from toolkit.data import load_text
    from toolkit.quant.checkpoint import save_quantized
    from toolkit.quant.formats import export_checkpoint
    from toolkit.quant.model_quant import QuantRecipe, quantize_model

    text = "\n".join(load_text("pydoc")["text"][:20])
    ids = smollm2.tokenizer(text[:4000], return_tensors="pt").input_ids[:, :128]
    qsd = quantize_model(smollm2.model, QuantRecipe(bits=4, group_size=64, symmetric=symmetric), progress=False)
    ck = save_quantized(tmp_path / "ck", smollm2.model, qsd, tokenizer=smollm2.tokenizer, source="smollm2-135m")
    _check(export_checkpoint(ck, fmt, tmp_path / fmt), f"smollm2 rtn w4g64 {fmt}", ids)
