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
    search_clip_range,
    search_scales,
)
from toolkit.quant.block_passes import capture_inputs, collect_statistics, decoder_blocks
from toolkit.quant.calibrate import make_quantized_state_dict
from toolkit.quant.calibration_data import calibration_batches
from toolkit.quant.layer_quantizers import awq_options
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


def _searched_linear(seed: int, x: torch.Tensor):
    """(w, a bias-free 128 -> 96 Linear holding w, AWQ's (s, alpha, loss) for it on inputs x)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(96, 128, generator=g) * 0.05
    lin = nn.Linear(128, 96, bias=False)
    lin.weight.data.copy_(w)
    return w, lin, search_scales(x, [lin], CONFIG, AWQOptions())


def test_awq_scales_beat_rtn_on_outlier_channels():
    x = _outlier_inputs()
    w, lin, (s, alpha, _) = _searched_linear(1, x)
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


def _group_output_errors(x, w, q, config) -> torch.Tensor:
    """``[out, g]``: mean over tokens of each group's squared output error, the tokens run through the group."""
    from toolkit.quant.primitives import pad_to_groups

    gs = config.group_size
    xs = pad_to_groups(x, config).reshape(x.shape[0], -1, gs)
    delta = (pad_to_groups(q, config) - pad_to_groups(w, config)).reshape(w.shape[0], -1, gs)
    return torch.einsum("tgk,ogk->otg", xs, delta).pow(2).mean(1)


def test_asymmetric_clip_lowers_skewed_groups_error_below_the_symmetric_clip():
    """A group with one long tail and one short: the symmetric search can only shrink the long side; shrinking each
    end on its own (`search_clip_range`) never measures worse per group, and is better in many."""
    g = torch.Generator().manual_seed(11)
    config = QuantConfig(bits=4, group_size=32, symmetric=False)
    w = torch.randn(48, 96, generator=g).abs() * 0.05 - 0.01  # mostly positive: a short negative tail
    w[:, 5] = -0.04 - 0.02 * torch.rand(48, generator=g)  # a few outliers on the short side, group 0
    w[:, 37] = -0.04 - 0.02 * torch.rand(48, generator=g)  # group 1
    w[:, 70] = -0.04 - 0.02 * torch.rand(48, generator=g)  # group 2
    x = torch.randn(512, 96, generator=g)
    options = AWQOptions(clip_tokens=512)
    lo, hi = search_clip_range(w, x, config, options)
    m = search_clip(w, x, config, options)
    groups = w.reshape(48, 3, 32)
    symmetric = torch.clamp(groups, -m[..., None], m[..., None]).reshape(48, 96)
    ranged = torch.minimum(torch.maximum(groups, lo[..., None]), hi[..., None]).reshape(48, 96)
    err_sym = _group_output_errors(x, w, fake_quantize(symmetric, config), config)
    err_asym = _group_output_errors(x, w, fake_quantize(ranged, config), config)
    assert bool((err_asym <= err_sym * (1 + 1e-5)).all())
    assert float((err_asym < 0.99 * err_sym).float().mean()) > 0.25  # 37% of the groups here (seed 12: 41%)
    assert float(err_asym.sum()) < 0.98 * float(err_sym.sum())  # 0.963 of it here (0.957); symmetric/none 0.943
    assert bool((lo > groups.amin(-1)).any())  # some short (negative) tail was clipped on its own
    # the recipe knob reaches AWQ's options; a mirrored grid cannot follow two ends
    assert awq_options(QuantRecipe(method="awq", symmetric=False, awq_clip_asym=True)).clip_asym
    with pytest.raises(ValueError, match="awq_clip_asym .* symmetric=false"):
        QuantRecipe(method="awq", symmetric=True, awq_clip_asym=True)


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


@pytest.mark.parametrize("gqa_v_o", [False, True])
@torch.no_grad()
def test_fold_keeps_float_block_output_and_finds_the_feeding_norms(arch_dir, tiny_tokenizer, gqa_v_o):
    arch, path = arch_dir
    model = _load(path)
    batches = calibration_batches(tiny_tokenizer, n_samples=4, seq_len=32, seed=0)
    _, blocks = decoder_blocks(model)
    inputs, kwargs = capture_inputs(model, blocks, batches, torch.device("cpu"))
    block = blocks[0]
    linears = {n: m for n, m in quantizable_linears(model, QuantRecipe(group_size=32))[0].items()
               if n.startswith(decoder_blocks(model)[0] + ".0.")}
    quantizer = AWQLayerQuantizer(CONFIG, AWQOptions(clip=False, search_samples=2, gqa_v_o=gqa_v_o))
    accumulators, producers = collect_statistics(block, inputs, kwargs[0], linears, quantizer, stop_early=False)
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
    o_before = block.self_attn.o_proj.weight.clone()
    quantizer.prepare_block(block, linears, accumulators, producers)
    after = [run(x) for x in inputs]
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # the fold did change the model (the test above could otherwise pass vacuously)
    assert not torch.equal(block.input_layernorm.weight, norms_before["input_layernorm"])
    assert set(quantizer.last_report) >= {"qkv", "gate,up", "up->down"}
    attn = block.self_attn
    assert attn.v_proj.out_features * 2 == attn.o_proj.in_features  # GQA: 2 kv heads, 4 query heads
    if not gqa_v_o:  # AutoAWQ's rule: no v -> o under GQA
        assert "v->o" not in quantizer.last_report
        assert torch.equal(attn.o_proj.weight, o_before)
        return
    # v -> o with one scale per kv channel: o's columns scaled alike for the two query heads of each kv head
    assert "v->o" in quantizer.last_report
    s = attn.o_proj.weight[0] / o_before[0]
    assert not torch.allclose(s, torch.ones_like(s))  # it did scale (the equality above is then not vacuous)
    by_head = s.reshape(2, 2, attn.head_dim)  # [kv head, query head of its group, channel]
    torch.testing.assert_close(by_head[:, 0], by_head[:, 1])


def test_fold_into_linear_producer_is_exact():
    g = torch.Generator().manual_seed(3)
    up, down = nn.Linear(16, 32), nn.Linear(32, 16, bias=False)
    x = torch.randn(8, 16, generator=g)
    ref = down(up(x) * 2.0)
    s = torch.rand(32, generator=g) + 0.5
    fold_scales(up, [down], s)
    torch.testing.assert_close(down(up(x) * 2.0), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("clip_asym", [False, True])
def test_awq_end_to_end_checkpoint(arch_dir, tiny_tokenizer, tmp_path, clip_asym):
    from toolkit.quant.checkpoint import load_quantized, save_quantized
    from toolkit.quant.model_quant import swap_quantized_modules
    from toolkit.quant.qlinear import QuantLinear

    arch, path = arch_dir
    model = _load(path)
    recipe = QuantRecipe(method="awq", bits=4, group_size=32, symmetric=False, n_samples=4, seq_len=32,
                         awq_search_samples=2, awq_grid=5, awq_clip_asym=clip_asym,
                         experimental={"awq_clip_grid": 5, "awq_clip_tokens": 64})
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
    lo, hi = search_clip_range(w, x, config, AWQOptions(clip_tokens=1024))
    assert lo.shape == hi.shape == (32, 2) and bool((lo <= 0).all()) and bool((hi >= 0).all())
    ranged = torch.minimum(torch.maximum(padded, lo[..., None]), hi[..., None]).reshape(32, 128)[:, :96]
    assert _rel_output_error(x, w, fake_quantize(ranged, config)) <= _rel_output_error(x, w, fake_quantize(clipped,
                                                                                                         config))


def test_scale_search_loss_through_the_gram_matrix_is_the_output_error():
    """For the Linears' own outputs the search measures tr(ΔW xᵀx ΔWᵀ) instead of running x through every
    candidate: the same loss, so the same alpha as measuring the outputs directly (an explicit ``inspect``)."""
    torch.manual_seed(3)
    x = torch.randn(600, 64) * torch.linspace(0.1, 8, 64)  # outlier channels: the search has a real optimum
    lins = [nn.Linear(64, 48, bias=False), nn.Linear(64, 16, bias=False)]
    options = AWQOptions()

    def direct(xs, ws):
        return torch.cat([xs @ w.t() for w in ws], dim=-1)

    s_gram, alpha_gram, loss_gram = search_scales(x, lins, CONFIG, options, x_search=x[:256])
    s_direct, alpha_direct, loss_direct = search_scales(x, lins, CONFIG, options, x_search=x[:256], inspect=direct)
    assert alpha_gram == alpha_direct and alpha_gram > 0
    assert loss_gram == pytest.approx(loss_direct, rel=1e-4)
    torch.testing.assert_close(s_gram, s_direct)


@pytest.mark.parametrize("seed", [3, 4, 5, 6])
def test_coarse_to_fine_alpha_search_tries_fewer_alphas_and_keeps_the_grids_best_here(seed):
    """coarse_step=2: every other alpha, then the best one's grid neighbours: 11-12 losses instead of 20, and on
    these outlier inputs (a loss curve with one broad minimum) the full grid's alpha and scales."""
    torch.manual_seed(seed)
    x = torch.randn(600, 64) * torch.linspace(0.1, 8, 64).pow(1 + seed / 4)
    lins = [nn.Linear(64, 48, bias=False), nn.Linear(64, 16, bias=False)]
    calls = []

    def direct(xs, ws):
        calls.append(1)
        return torch.cat([xs @ w.t() for w in ws], dim=-1)

    results = {}
    for step in (1, 2):
        calls.clear()
        results[step] = search_scales(x, lins, CONFIG, AWQOptions(coarse_step=step), x_search=x[:256],
                                      inspect=direct)
        results[step] += (len(calls) - 1,)  # candidate losses (one call is the float reference)
    assert results[1][3] == 20 and 11 <= results[2][3] <= 12
    assert results[2][1] == results[1][1] and results[2][2] == results[1][2]
    torch.testing.assert_close(results[2][0], results[1][0])
    with pytest.raises(ValueError, match="coarse_step"):
        AWQOptions(coarse_step=0)


def test_clip_search_through_group_grams_picks_the_directly_measured_best():
    """The clip search scores each shrink by Δ G_g Δᵀ; running the tokens through every candidate (AutoAWQ's
    way, written out here) gives the same errors, so the same maxima — also with a ragged last group."""
    g = torch.Generator().manual_seed(5)
    config = QuantConfig(bits=4, group_size=32, symmetric=False)
    w = torch.randn(40, 80, generator=g) * 0.05  # 80 = 2.5 groups of 32
    w[:, 3] *= 6
    x = torch.randn(300, 80, generator=g) * torch.linspace(0.2, 3, 80)
    options = AWQOptions(clip_tokens=300)
    got = search_clip(w, x, config, options)

    from toolkit.quant.primitives import pad_to_groups

    xs = pad_to_groups(x, config).reshape(300, 3, 32)
    wp = pad_to_groups(w, config).reshape(40, 3, 32)
    org_max = wp.abs().amax(-1, keepdim=True)
    reference = torch.einsum("tgk,ogk->otg", xs, wp)
    errors, maxima = [], []
    for i in range(int(options.max_shrink * options.clip_grid)):
        max_val = org_max * (1 - i / options.clip_grid)
        q = fake_quantize(torch.clamp(wp, -max_val, max_val).reshape(40, 96), config).reshape(wp.shape)
        errors.append((torch.einsum("tgk,ogk->otg", xs, q) - reference).pow(2).mean(1))
        maxima.append(max_val.squeeze(-1))
    errors, maxima = torch.stack(errors), torch.stack(maxima)  # [steps, out, g]
    expected = maxima.gather(0, errors.argmin(0, keepdim=True)).squeeze(0)  # first minimum, as the search keeps
    assert got.shape == (40, 3)
    assert (got == expected).float().mean() > 0.99  # equal but for near-ties (two sums of one error)
    assert bool((got < org_max.squeeze(-1)).any())


def _awq_recipe(awq_next_inputs="float", **kw):
    return QuantRecipe(method="awq", bits=4, group_size=32, symmetric=False, n_samples=4, seq_len=32,
                       awq_search_samples=2, awq_grid=5, **kw,
                       experimental={"awq_clip_grid": 5, "awq_clip_tokens": 64, "awq_next_inputs": awq_next_inputs})


def test_awq_bf16_calibration_folds_into_the_fp32_block(tiny_llama_dir, tiny_tokenizer):
    """calib_dtype=bf16: the statistics forward runs on a bf16 copy of each block; the scales are folded into the
    fp32 block's own norms (the copy's producers are mapped back), every weight stays fp32, the model holds the
    saved codes, and the quality is that of fp32 calibration (bf16 rounding of the inputs, not a different fit)."""
    from toolkit.quant.blockwise import quantize_blockwise
    from toolkit.quant.layer_quantizers import layer_quantizer_for

    batches = calibration_batches(tiny_tokenizer, n_samples=4, seq_len=32, seed=0)
    original = _load(tiny_llama_dir)
    with torch.no_grad():
        reference = original(input_ids=batches).logits
    errors = {}
    for dtype in ("fp32", "bf16"):
        recipe = _awq_recipe(calib_dtype=dtype)
        model = _load(tiny_llama_dir)
        qsd = quantize_blockwise(model, recipe, batches, layer_quantizer_for(recipe), progress=False)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        for name, qw in qsd.weights.items():
            assert torch.equal(model.get_submodule(name).weight, qw.dequantize(torch.float32)), name
        folded = [not torch.equal(block.input_layernorm.weight, decoder_blocks(original)[1][i].input_layernorm.weight)
                  for i, block in enumerate(decoder_blocks(model)[1])]
        assert any(folded), dtype  # the scales went into the model's own norms (alpha 0 leaves a norm as it is)
        with torch.no_grad():
            errors[dtype] = float((model(input_ids=batches).logits - reference).pow(2).mean())
    assert errors["bf16"] < 1.3 * errors["fp32"], errors


@pytest.mark.parametrize("next_inputs", ["quantized", "float"])
def test_awq_next_block_inputs(tiny_llama_dir, tiny_tokenizer, next_inputs):
    """experimental.awq_next_inputs=float (AutoAWQ's scheme): one calibration forward per block, whose float outputs are the
    next block's inputs, i.e. the float model's own hidden states; quantized: a second forward per block
    through the scaled, clipped, rounded block, so block 1 calibrates on different inputs."""
    from toolkit.quant.blockwise import quantize_blockwise
    from toolkit.quant.layer_quantizers import layer_quantizer_for

    batches = calibration_batches(tiny_tokenizer, n_samples=4, seq_len=32, seed=0)
    with torch.no_grad():
        hidden = _load(tiny_llama_dir)(input_ids=batches, output_hidden_states=True).hidden_states
    recipe = _awq_recipe(calib_dtype="fp32", awq_next_inputs=next_inputs)
    model = _load(tiny_llama_dir)
    blocks = decoder_blocks(model)[1]
    seen = [[] for _ in blocks]
    handles = [b.register_forward_pre_hook(lambda m, args, kwargs, i=i: seen[i].append(
        (args[0] if args else kwargs["hidden_states"]).detach().clone()), with_kwargs=True)
        for i, b in enumerate(blocks)]
    quantize_blockwise(model, recipe, batches, layer_quantizer_for(recipe), progress=False)
    for h in handles:
        h.remove()
    calibration = [calls[-1] if next_inputs == "float" else calls[-2] for calls in seen]  # the statistics forward
    forwards = [sum(c.shape[0] == 4 for c in calls) for calls in seen]  # whole-batch calls (capture goes per sample)
    if next_inputs == "float":
        assert forwards == [1] * len(blocks)
        torch.testing.assert_close(calibration[1], hidden[1], rtol=1e-4, atol=1e-4)
    else:
        assert forwards[:-1] == [2] * (len(blocks) - 1) and forwards[-1] == 1  # the last block needs no outputs
        assert not torch.allclose(calibration[1], hidden[1], rtol=1e-3, atol=1e-3)


def test_awq_next_inputs_is_validated():
    with pytest.raises(ValueError, match="awq_next_inputs"):
        QuantRecipe(method="awq", experimental={"awq_next_inputs": "bf16"})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_input_collector_reads_rows_and_channel_means_without_concatenating(dtype):
    """...and without touching the collected inputs: fp32 calibration once had ``mean_abs`` overwrite them with
    |x| in place (the clip search and GPTQ rounding then read |x|)."""
    from toolkit.quant.awq import InputCollector

    g = torch.Generator().manual_seed(6)
    parts = [torch.randn(b, 5, 12, generator=g).to(dtype) for b in (2, 1, 3)]  # [batch, seq, in] slices
    originals = [part.clone() for part in parts]
    collector = InputCollector()
    for part in parts:
        collector.add(part)
    every = torch.cat([p.reshape(-1, 12) for p in originals]).float()
    assert collector.n_rows == 30
    index = torch.tensor([0, 4, 9, 10, 11, 15, 29])
    torch.testing.assert_close(collector.mean_abs(), every.abs().mean(0))
    torch.testing.assert_close(collector.take_rows(index), every[index])
    assert all(torch.equal(kept, original) for kept, original in zip(collector.inputs, originals))


def _correlated_outlier_inputs(tokens=4096, cols=128, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cols, generator=g) @ torch.randn(cols, cols, generator=g) / cols ** 0.5
    x = x + 0.05 * torch.randn(tokens, cols, generator=g)
    x[:, :4] *= 30.0
    return x


def test_awq_gptq_rounding_solves_under_the_scaled_inputs_hessian():
    """awq_rounding=gptq: after the fold the Linear reads x / s, and its codes are GPTQ's under the Hessian of
    x / s, got from the float inputs' Hessian as H / (s sᵀ) (no second pass over the data); on correlated inputs
    with outlier channels they beat AWQ's round-to-nearest codes on the same scaled weight by a margin."""
    from toolkit.quant.layer_quantizers import GPTQLayerQuantizer
    from toolkit.quant.gptq import HessianAccumulator, gptq_quantize

    x = _correlated_outlier_inputs()
    _, lin, (s, _, _) = _searched_linear(4, x)
    lin.weight.data.mul_(s)  # the fold: the Linear's columns times s, its input divided by s
    recipe = QuantRecipe(method="awq", bits=4, group_size=32, symmetric=False, awq_rounding="gptq")
    quantizer = AWQLayerQuantizer(CONFIG, AWQOptions(), GPTQLayerQuantizer(recipe))
    quantizer._scales = {id(lin): s}
    collector = quantizer.accumulator(lin)
    for part in x.split(1000):
        collector.add(part)
    qw = quantizer.quantize("layer", lin, collector)

    direct = HessianAccumulator(128)
    direct.add(x / s)
    expected, _ = gptq_quantize(lin.weight, direct.hessian, CONFIG, damp_percent=recipe.damp_percent)
    assert float((qw.codes == expected.codes).float().mean()) > 0.995  # equal but for fp32 rounding at ties

    rtn = AWQLayerQuantizer(CONFIG, AWQOptions()).quantize("layer", lin, collector)
    xs = x / s
    err = {name: _rel_output_error(xs, lin.weight.detach(), q.dequantize().float()) for name, q in (("gptq", qw), ("rtn", rtn))}
    assert err["gptq"] < 0.8 * err["rtn"], err


def test_awq_gptq_rounding_end_to_end(tiny_llama_dir, tiny_tokenizer):
    """The blockwise driver with awq_rounding=gptq: every Linear quantized, codes unlike AWQ's round-to-nearest
    ones, the GPTQ knobs in the quantizer's fingerprint (resumable runs tell the two apart)."""
    from toolkit.quant.layer_quantizers import layer_quantizer_for

    runs = {}
    for rounding in ("rtn", "gptq"):
        recipe = _awq_recipe(calib_dtype="fp32", awq_rounding=rounding, awq_clip=False, act_order=True)
        runs[rounding] = make_quantized_state_dict(_load(tiny_llama_dir), tiny_tokenizer, recipe, progress=False)
        assert set(runs[rounding].weights) == set(quantizable_linears(_load(tiny_llama_dir), recipe)[0])
    changed = [n for n in runs["rtn"].weights
               if not torch.equal(runs["rtn"].weights[n].codes, runs["gptq"].weights[n].codes)]
    assert len(changed) == len(runs["rtn"].weights)
    assert any(qw.g_idx is not None for qw in runs["gptq"].weights.values())  # act-order reached the solve
    fingerprint = layer_quantizer_for(_awq_recipe(awq_rounding="gptq", act_order=True)).fingerprint()
    assert fingerprint["rounding"]["act_order"] is True
    assert "rounding" not in layer_quantizer_for(_awq_recipe()).fingerprint()
    with pytest.raises(ValueError, match="awq_rounding"):
        QuantRecipe(method="awq", awq_rounding="nearest")


def test_awq_then_gptq_sequential_runs_gptqs_own_pass_on_the_folded_float_model(tiny_llama_dir, tiny_tokenizer,
                                                                                 tmp_path):
    """awq_rounding=gptq-sequential: a first pass folds AWQ's scales into the float model (an equivalent model:
    the same logits, other weights) and rounds nothing; GPTQ's true-sequential pass (GPTAQ included) then
    quantizes that model. So the codes are exactly those of a plain GPTQ run on the folded model; they differ
    from the one-pass awq_rounding=gptq codes; a resumed run (state_dir) reuses the saved fold and gives the
    same codes; gptaq_alpha is refused for the one-pass rounding and allowed here."""
    import dataclasses

    from toolkit.quant.blockwise import quantize_blockwise
    from toolkit.quant.layer_quantizers import GPTQLayerQuantizer

    batches = calibration_batches(tiny_tokenizer, n_samples=4, seq_len=32, seed=0)
    recipe = _awq_recipe(calib_dtype="fp32", awq_rounding="gptq-sequential", awq_clip=False, act_order=True,
                         mse=True, gptaq_alpha=0.5)
    original = _load(tiny_llama_dir)
    model = _load(tiny_llama_dir)
    qsd = make_quantized_state_dict(model, tiny_tokenizer, recipe, progress=False, state_dir=tmp_path / "state")
    assert set(qsd.weights) == set(quantizable_linears(original, recipe)[0])
    assert any(k.startswith("AWQ pass: ") for k in qsd.timings) and any(k.startswith("GPTQ pass: ")
                                                                       for k in qsd.timings)
    folded = torch.load(tmp_path / "state" / "awq_folded.pt", weights_only=True)["blocks"]
    norms = [k for k in folded if k.endswith("layernorm.weight")]
    blocks = decoder_blocks(original)[1]
    assert any(not torch.equal(folded[k], blocks.state_dict()[k]) for k in norms)  # scales went into the norms
    # the fold alone keeps the float model's function
    refolded = _load(tiny_llama_dir)
    decoder_blocks(refolded)[1].load_state_dict(folded)
    with torch.no_grad():
        torch.testing.assert_close(refolded(input_ids=batches).logits, original(input_ids=batches).logits,
                                   rtol=1e-4, atol=1e-4)
    # the second pass is GPTQ's own, on that model
    gptq = dataclasses.replace(recipe, method="gptq", awq_rounding="rtn")
    plain = quantize_blockwise(refolded, gptq, batches, GPTQLayerQuantizer(gptq), progress=False)
    for name, qw in qsd.weights.items():
        assert torch.equal(qw.codes, plain.weights[name].codes), name
    # resumed from the state: the fold is loaded, not searched again, and the codes are the same
    resumed = make_quantized_state_dict(_load(tiny_llama_dir), tiny_tokenizer, recipe, progress=False,
                                        state_dir=tmp_path / "state")
    assert not any(k.startswith("AWQ pass: ") for k in resumed.timings)
    assert all(torch.equal(resumed.weights[n].codes, qw.codes) for n, qw in qsd.weights.items())
    one_pass = make_quantized_state_dict(_load(tiny_llama_dir), tiny_tokenizer,
                                         dataclasses.replace(recipe, awq_rounding="gptq", gptaq_alpha=0.0),
                                         progress=False)
    assert any(not torch.equal(one_pass.weights[n].codes, qw.codes) for n, qw in qsd.weights.items())
    with pytest.raises(ValueError, match="gptq-sequential"):
        _awq_recipe(awq_rounding="gptq", gptaq_alpha=0.5)
    with pytest.raises(ValueError, match="different run"):
        make_quantized_state_dict(_load(tiny_llama_dir), tiny_tokenizer, dataclasses.replace(recipe, awq_grid=4),
                                  progress=False, state_dir=tmp_path / "state")
