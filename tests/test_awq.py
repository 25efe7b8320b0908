"""AWQ: scale search beats RTN on outlier channels, the fold keeps the float block's function, and the whole
pipeline (blockwise calibration -> checkpoint -> load) works on tiny Llama and Gemma 3 models."""

import copy

import pytest
import torch
from torch import nn

from toolkit.quant.awq import (
    AWQLayerQuantizer,
    AWQOptions,
    fake_quantize,
    fold_scales,
    norm_kind,
    search_clip,
    search_scales,
)
from toolkit.quant.calibrate import _capture, _collect, calibration_batches, decoder_blocks, make_quantized_state_dict
from toolkit.quant.model_quant import QuantRecipe, quantizable_linears
from toolkit.quant.primitives import QuantConfig

CONFIG = QuantConfig(bits=4, group_size=32, symmetric=False)


def _outlier_inputs(tokens=2048, cols=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cols, generator=g)
    x[:, :4] *= 30.0  # a few channels carry large activations (the LLM pattern AWQ exploits)
    return x


def _rel_output_error(x, w, wq):
    ref = x @ w.t()
    return float((x @ wq.t() - ref).pow(2).mean() / ref.pow(2).mean())


def test_awq_scales_beat_rtn_on_outlier_channels():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 128, generator=g) * 0.05
    x = _outlier_inputs()
    lin = nn.Linear(128, 96, bias=False)
    lin.weight.data.copy_(w)
    s, alpha, _ = search_scales(x, [lin], CONFIG, AWQOptions())
    awq = fake_quantize(w * s, CONFIG) / s
    rtn_err = _rel_output_error(x, w, fake_quantize(w, CONFIG))
    awq_err = _rel_output_error(x, w, awq)
    assert alpha > 0  # the search did scale the outlier channels
    assert awq_err < 0.7 * rtn_err, (awq_err, rtn_err)


def test_clip_search_never_worse_than_no_clip():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 128, generator=g) * 0.05
    w[:, 7] *= 8  # heavy-tailed weights: shrinking the range pays off
    x = torch.randn(1024, 128, generator=g)
    max_val = search_clip(w, x, CONFIG, AWQOptions(clip_tokens=1024))
    clipped = torch.clamp(w.reshape(64, -1, 32), -max_val[..., None], max_val[..., None]).reshape(64, 128)
    plain = _rel_output_error(x, w, fake_quantize(w, CONFIG))
    assert _rel_output_error(x, w, fake_quantize(clipped, CONFIG)) <= plain
    assert bool((max_val < w.abs().reshape(64, -1, 32).amax(-1)).any())  # some range did shrink


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(params=["llama", "gemma3"])
def arch_dir(request, tiny_llama_dir, tiny_gemma3_dir):
    return request.param, tiny_llama_dir if request.param == "llama" else tiny_gemma3_dir


def test_norm_kind_probed(arch_dir):
    arch, path = arch_dir
    block = decoder_blocks(_load(path))[1][0]
    hidden = block.input_layernorm.weight.numel()
    assert norm_kind(block.input_layernorm, hidden) == ("offset" if arch == "gemma3" else "plain")


@torch.no_grad()
def test_fold_keeps_float_block_output_and_finds_the_feeding_norms(arch_dir, tiny_tokenizer):
    arch, path = arch_dir
    model = _load(path)
    batches = calibration_batches(tiny_tokenizer, n_samples=4, seq_len=32, seed=0)
    _, blocks = decoder_blocks(model)
    inputs, kwargs = _capture(model, blocks, batches, torch.device("cpu"))
    block = blocks[0]
    linears = {n: m for n, m in quantizable_linears(model, QuantRecipe(group_size=32))[0].items()
               if n.startswith(decoder_blocks(model)[0] + ".0.")}
    quantizer = AWQLayerQuantizer(CONFIG, AWQOptions(clip=False, search_samples=2))
    accumulators, producers = _collect(block, inputs, kwargs[0], linears, quantizer, stop_early=False)
    mlp_norm = "pre_feedforward_layernorm" if arch == "gemma3" else "post_attention_layernorm"
    for name in linears:
        suffix = name.rsplit(".", 1)[-1]
        if suffix in ("q_proj", "k_proj", "v_proj"):
            assert producers[name] is block.input_layernorm
        elif suffix in ("gate_proj", "up_proj"):
            assert producers[name] is getattr(block, mlp_norm)
    # q, k, v read one tensor: one shared collector, not three copies
    q, k = (next(n for n in linears if n.endswith(s)) for s in ("q_proj", "k_proj"))
    assert accumulators[q] is accumulators[k]

    def run(x):
        out = block(x, **kwargs[0])
        return out[0] if isinstance(out, tuple) else out

    before = [run(x) for x in inputs]
    norms_before = {n: m.weight.clone() for n, m in block.named_modules() if n.endswith("norm") and hasattr(m, "weight")}
    quantizer.prepare_block(block, linears, accumulators, producers)
    after = [run(x) for x in inputs]
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # the fold did change the model (the test above could otherwise pass vacuously)
    assert not torch.equal(block.input_layernorm.weight, norms_before["input_layernorm"])
    assert set(quantizer.last_report) >= {"qkv", "gate,up", "up->down"}
    assert "v->o" not in quantizer.last_report  # GQA (2 kv heads, 4 heads): AutoAWQ skips it too


def test_fold_into_linear_producer_is_exact():
    g = torch.Generator().manual_seed(3)
    up, down = nn.Linear(16, 32), nn.Linear(32, 16, bias=False)
    x = torch.randn(8, 16, generator=g)
    ref = down(up(x) * 2.0)
    s = torch.rand(32, generator=g) + 0.5
    fold_scales(up, [down], s)
    torch.testing.assert_close(down(up(x) * 2.0), ref, rtol=1e-5, atol=1e-5)


def test_awq_end_to_end_checkpoint(arch_dir, tiny_tokenizer, tmp_path):
    from toolkit.quant.checkpoint import load_quantized, save_quantized
    from toolkit.quant.model_quant import swap_quantized_modules
    from toolkit.quant.qlinear import QuantLinear

    arch, path = arch_dir
    model = _load(path)
    recipe = QuantRecipe(method="awq", bits=4, group_size=32, symmetric=False, n_samples=4, seq_len=32,
                         awq_search_samples=2, awq_grid=5, awq_clip_grid=5, awq_clip_tokens=64)
    float_model = copy.deepcopy(model)
    qsd = make_quantized_state_dict(model, tiny_tokenizer, recipe, progress=False)
    linears, _ = quantizable_linears(float_model, recipe)
    assert set(qsd.weights) == set(linears)
    out = save_quantized(tmp_path / "ckpt", model, qsd, tokenizer=tiny_tokenizer, source=str(path))
    loaded, qsd2, _ = load_quantized(out)
    swap_quantized_modules(loaded, qsd2, QuantLinear.from_quantized)  # the runtime path: packed int4 kernels
    ids = calibration_batches(tiny_tokenizer, n_samples=2, seq_len=24, seed=9)
    with torch.no_grad():
        fake = model(input_ids=ids).logits  # the driver left the model fake-quantized (folded + rounded)
        got = loaded(input_ids=ids).logits.float()
        ref = float_model(input_ids=ids).logits
    # QuantLinear runs bf16 activations: compare relative to the logits' scale
    assert float((got - fake).abs().max()) < 0.05 * float(fake.abs().max())
    assert not torch.allclose(got, ref, atol=1e-4)  # it is quantized
    assert qsd2.recipe.method == "awq"


def test_scale_and_clip_search_on_a_ragged_last_group():
    """96 inputs at group 64 (groups of 64 and 32): one max per group, and neither search makes the error worse."""
    config = QuantConfig(bits=4, group_size=64, symmetric=False)
    g = torch.Generator().manual_seed(4)
    w = torch.randn(32, 96, generator=g) * 0.05
    w[:, 90] *= 8  # a heavy column in the short group
    x = _outlier_inputs(cols=96)
    lin = nn.Linear(96, 32, bias=False)
    lin.weight.data.copy_(w)
    s, _, _ = search_scales(x, [lin], config, AWQOptions())
    assert s.shape == (96,)
    plain = _rel_output_error(x, w, fake_quantize(w, config))
    assert _rel_output_error(x, w, fake_quantize(w * s, config) / s) <= plain
    max_val = search_clip(w, x, config, AWQOptions(clip_tokens=1024))
    assert max_val.shape == (32, 2)
    padded = torch.nn.functional.pad(w, (0, 32)).reshape(32, 2, 64)
    clipped = torch.clamp(padded, -max_val[..., None], max_val[..., None]).reshape(32, 128)[:, :96]
    assert _rel_output_error(x, w, fake_quantize(clipped, config)) <= plain
