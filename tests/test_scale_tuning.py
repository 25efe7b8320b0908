"""End-to-end scale tuning (toolkit.quant.scale_tuning): the scales move, nothing else does, the model's output
gets closer to the float model's (on the windows tuned on and on others), and a killed run resumes exactly."""

import copy
import dataclasses

import pytest
import torch
from torch.nn.utils import parametrize

from toolkit.quant import scale_tuning
from toolkit.quant.calibrate import make_quantized_state_dict
from toolkit.quant.calibration_data import calibration_batches
from toolkit.quant.model_quant import QuantRecipe
from toolkit.quant.scale_tuning import ScaleTuneOptions, tune_scales


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _recipe(**kw):
    base = dict(method="rtn", bits=4, group_size=32, symmetric=False, dataset="pydoc", n_samples=8, seq_len=32,
                calib_dtype="fp32")
    return QuantRecipe(**{**base, **kw})


@torch.no_grad()
def _kl(model, reference, batches) -> float:
    return float(scale_tuning._kl_per_token(model(batches).logits, reference(batches).logits).mean())


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tuned_scales_lower_the_kl_to_the_float_model_and_only_the_scales_change(arch, tiny_llama_dir,
                                                                                 tiny_gemma3_dir, tiny_tokenizer):
    path = tiny_llama_dir if arch == "llama" else tiny_gemma3_dir
    float_model = _load(path)
    plain_model, tuned_model = _load(path), _load(path)
    recipe = _recipe(n_samples=16, seq_len=64)
    plain = make_quantized_state_dict(plain_model, tiny_tokenizer, recipe, progress=False)
    tuned = make_quantized_state_dict(tuned_model, tiny_tokenizer,
                                      dataclasses.replace(recipe, tune_scales_epochs=3, tune_scales_lr=0.003),
                                      progress=False)
    assert plain.tuning is None and "scale tuning" in tuned.timings
    assert set(tuned.weights) == set(plain.weights)
    moved = 0
    for name, qw in tuned.weights.items():
        before = plain.weights[name]
        assert torch.equal(qw.codes, before.codes) and torch.equal(qw.zero, before.zero), name
        assert bool((qw.scale > 0).all()), name
        moved += int(not torch.equal(qw.scale, before.scale))
        # the model is left fake-quantized with the tuned scales, as the calibrating driver leaves it
        linear = tuned_model.get_submodule(name)
        assert not parametrize.is_parametrized(linear) and not linear.weight.requires_grad
        torch.testing.assert_close(linear.weight, qw.dequantize(torch.float32))
    assert moved == len(tuned.weights)
    # RTN leaves the model as it was: run it with the untuned codes to compare the two on the same footing
    for name, qw in plain.weights.items():
        plain_model.get_submodule(name).weight.data.copy_(qw.dequantize(torch.float32))
    seen = calibration_batches(tiny_tokenizer, "pydoc", 16, 64)
    unseen = calibration_batches(tiny_tokenizer, "pydoc", 16, 64, seed=1)  # windows it was not tuned on
    assert _kl(tuned_model, float_model, seen) < 0.9 * _kl(plain_model, float_model, seen)
    # a random tiny model's text carries little structure to generalize from, so only "better" here (SmolLM2's
    # held-out evaluation windows are the real measure: docs/notes/2026-12-quantization-methods-what-was-tried.md)
    assert _kl(tuned_model, float_model, unseen) < _kl(plain_model, float_model, unseen)
    report = tuned.tuning
    assert report["steps"] == 3 * 16 and report["kl_after"] < 0.9 * report["kl_before"]
    assert report["kl_before"] == pytest.approx(_kl(plain_model, float_model, seen[:scale_tuning._REPORT_WINDOWS]),
                                                rel=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tuned_norms_lower_the_kl_further_and_the_checkpoint_keeps_them(arch, tiny_llama_dir, tiny_gemma3_dir,
                                                                         tiny_tokenizer, tmp_path):
    """``tune_norms``: the RMSNorm gains (Gemma's ``1 + w`` ones too) train beside the scales, from exactly where they
    were; the same codes with the same steps end closer to the float model, and a saved checkpoint holds the norms."""
    from toolkit.quant.checkpoint import load_quantized, save_quantized

    path = tiny_llama_dir if arch == "llama" else tiny_gemma3_dir
    float_model = _load(path)
    recipe = _recipe(n_samples=16, seq_len=64, tune_scales_epochs=3, tune_scales_lr=0.003)
    models, results = {}, {}
    for norms in (False, True):
        models[norms] = _load(path)
        results[norms] = make_quantized_state_dict(models[norms], tiny_tokenizer,
                                                   dataclasses.replace(recipe, tune_norms=norms), progress=False)
    norm_names = list(scale_tuning._norms(float_model))
    assert any(n.endswith("input_layernorm") for n in norm_names) and any(n.endswith(".norm") for n in norm_names)
    if arch == "gemma3":
        assert any(n.endswith("q_norm") for n in norm_names)
    for name in norm_names:
        reference = float_model.get_submodule(name).weight
        assert torch.equal(models[False].get_submodule(name).weight, reference), name  # RTN folds nothing
        tuned = models[True].get_submodule(name)
        assert not parametrize.is_parametrized(tuned) and not tuned.weight.requires_grad
        assert not torch.equal(tuned.weight, reference), name
    for name, qw in results[True].weights.items():  # the same codes: only scales and norms differ
        assert torch.equal(qw.codes, results[False].weights[name].codes), name
    seen = calibration_batches(tiny_tokenizer, "pydoc", 16, 64)
    assert _kl(models[True], float_model, seen) < _kl(models[False], float_model, seen)
    assert results[True].tuning["kl_after"] < results[False].tuning["kl_after"]
    save_quantized(tmp_path / "ckpt", models[True], results[True], tiny_tokenizer)
    loaded, _, _ = load_quantized(tmp_path / "ckpt")
    for name in norm_names:
        torch.testing.assert_close(loaded.get_submodule(name).weight.float(),
                                   models[True].get_submodule(name).weight.float())


def test_a_gain_parametrization_starts_at_the_norm_itself():
    w = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3
    for offset in (False, True):
        gain = scale_tuning._RelativeGain(w, offset)
        assert torch.equal(gain(w), w)  # theta = 0: bit for bit, not (1 + w) - 1
        gain.theta.data.fill_(0.1)
        expected = (w + 1) * torch.exp(torch.tensor(0.1)) - 1 if offset else w * torch.exp(torch.tensor(0.1))
        torch.testing.assert_close(gain(w), expected)


def test_a_killed_tuning_run_resumes_from_its_state_and_takes_the_same_steps(tiny_llama_dir, tiny_tokenizer,
                                                                             tmp_path, monkeypatch):
    recipe = _recipe()
    batches = calibration_batches(tiny_tokenizer, "pydoc", 6, 32)
    options = ScaleTuneOptions(epochs=2, lr=0.01, batch=2)

    def quantized():
        model = _load(tiny_llama_dir)
        qsd = make_quantized_state_dict(model, tiny_tokenizer, recipe, progress=False)
        return model, qsd.weights

    model, weights = quantized()
    whole, _ = tune_scales(model, _load(tiny_llama_dir), weights, batches, options, progress=False)

    monkeypatch.setattr(scale_tuning, "SAVE_EVERY", 2)
    save = scale_tuning.save_torch_atomic

    def killed_after_step_4(obj, path):
        save(obj, path)
        if obj["step"] == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(scale_tuning, "save_torch_atomic", killed_after_step_4)
    state = tmp_path / "scale_tune.pt"
    model, weights = quantized()
    with pytest.raises(KeyboardInterrupt):
        tune_scales(model, _load(tiny_llama_dir), weights, batches, options, progress=False, state_path=state)
    assert not any(parametrize.is_parametrized(m) for m in model.modules())  # left a plain model
    monkeypatch.setattr(scale_tuning, "save_torch_atomic", save)
    model, weights = quantized()
    resumed, report = tune_scales(model, _load(tiny_llama_dir), weights, batches, options, progress=False,
                                  state_path=state)
    assert report["kl_before"] is None and report["steps"] == 6
    for name, qw in whole.items():
        assert torch.equal(resumed[name].scale, qw.scale), name
    with pytest.raises(ValueError, match="different scale-tuning run"):
        tune_scales(model, _load(tiny_llama_dir), weights, batches, dataclasses.replace(options, lr=0.02),
                    progress=False, state_path=state)
    assert not any(parametrize.is_parametrized(m) for m in model.modules())


def test_scale_tuning_settings_are_validated(tiny_llama_dir):
    for bad in (dict(tune_scales_epochs=-1), dict(tune_scales_batch=0), dict(tune_scales_lr=0.0)):
        with pytest.raises(ValueError, match="scale tuning"):
            _recipe(**bad)
    with pytest.raises(ValueError, match="tune_norms .* tune_scales_epochs >= 1"):
        _recipe(tune_norms=True)
    model = _load(tiny_llama_dir)
    with pytest.raises(ValueError, match="epochs >= 1"):
        tune_scales(model, copy.deepcopy(model), {}, torch.zeros(1, 4, dtype=torch.long), ScaleTuneOptions(epochs=0))


def test_a_resumed_run_that_changes_only_the_tuning_reuses_the_quantized_blocks(tiny_llama_dir, tiny_tokenizer,
                                                                                tmp_path):
    """The blockwise pass's resume record leaves the tuning knobs out: their change keeps the finished blocks (no
    block is quantized again, the codes are the same); the tuning's own state is another run's and is refused."""
    recipe = _recipe(method="gptq", tune_scales_epochs=1, tune_scales_lr=0.003)
    state = tmp_path / "state"
    first = make_quantized_state_dict(_load(tiny_llama_dir), tiny_tokenizer, recipe, progress=False, state_dir=state)
    assert (state / "scale_tune.pt").exists() and len(first.timings) > 1  # block phases, then the tuning
    changed = dataclasses.replace(recipe, tune_scales_epochs=2)
    with pytest.raises(ValueError, match="different scale-tuning run"):
        make_quantized_state_dict(_load(tiny_llama_dir), tiny_tokenizer, changed, progress=False, state_dir=state)
    (state / "scale_tune.pt").unlink()
    second = make_quantized_state_dict(_load(tiny_llama_dir), tiny_tokenizer, changed, progress=False,
                                       state_dir=state)
    assert list(second.timings) == ["scale tuning"]  # every block restored from the state, none quantized again
    assert second.tuning["steps"] == 2 * 8
    for name, qw in first.weights.items():
        assert torch.equal(second.weights[name].codes, qw.codes), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_kl_and_its_gradient_are_autograds_over_whole_windows(monkeypatch, dtype):
    # chunks of 3 positions over 2 x 10 (9 scored: the last chunk ragged); the reference: F.kl_div of two
    # log_softmaxes, differentiated by autograd
    monkeypatch.setattr(scale_tuning, "_KL_CHUNK_ELEMENTS", 3 * 1000)
    gen = torch.Generator().manual_seed(0)
    student = (torch.randn(2, 10, 1000, generator=gen) * 4).to(dtype).requires_grad_()
    teacher = (torch.randn(2, 10, 1000, generator=gen) * 4).to(dtype)
    weights = torch.rand(2, 9, generator=gen)

    expected = torch.nn.functional.kl_div(student[:, 1:].float().log_softmax(-1),
                                          teacher[:, 1:].float().log_softmax(-1),
                                          log_target=True, reduction="none").sum(-1)
    (expected * weights).sum().backward()
    expected_grad, student.grad = student.grad.clone(), None
    got = scale_tuning._kl_per_token(student, teacher)
    (got * weights).sum().backward()

    assert got.shape == (2, 9)
    # the same float32 ops per position (at Gemma's 262,144 columns the log-softmax kernel's reduction order can
    # depend on the chunk's row count: within 1e-6 there)
    assert torch.equal(got, expected)
    assert student.grad.dtype == dtype
    assert torch.equal(student.grad[:, 0], torch.zeros_like(student.grad[:, 0]))  # BOS's position: not scored
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-7)
    torch.testing.assert_close(student.grad.float(), expected_grad.float(), **tol)
    assert float((student.grad.float() - expected_grad.float()).norm() / expected_grad.float().norm()) < 1e-4


def _group_scaled(g_idx, in_features, group_size=32):
    from toolkit.quant.primitives import QuantConfig
    from toolkit.quant.rtn import rtn_quantize

    weight = torch.randn(5, in_features, generator=torch.Generator().manual_seed(1))
    qw = rtn_quantize(weight, QuantConfig(bits=4, group_size=group_size, symmetric=False))
    if g_idx is not None:
        qw = dataclasses.replace(qw, g_idx=g_idx)
    return qw, scale_tuning._GroupScaledWeight(qw)


@pytest.mark.parametrize("in_features,g_idx,broadcast", [
    (96, None, True),  # three whole groups of consecutive columns
    (96, (torch.arange(96) % 3).int(), False),  # an act-order permutation
    (80, None, False),  # a ragged last group (zero-padded by the quantizer)
])
def test_a_group_scaled_weight_is_its_codes_times_the_trained_scales(in_features, g_idx, broadcast):
    # consecutive groups of one width take the broadcast path, the others a one-hot matmul; both are
    # (codes - zero) * scale per column's group, the dequantized weight at theta = 0, and the scale's gradient
    # is the sum over each group's columns
    qw, scaled = _group_scaled(g_idx, in_features)
    assert (scaled.width is not None) == broadcast
    torch.testing.assert_close(scaled(None), qw.dequantize(), rtol=1e-6, atol=0)
    with torch.no_grad():
        scaled.theta.copy_(torch.linspace(-0.3, 0.3, scaled.theta.numel()).reshape(scaled.theta.shape))
    grad_out = torch.randn(5, in_features, generator=torch.Generator().manual_seed(2))
    (scaled(None) * grad_out).sum().backward()
    groups = qw.group_index()
    offsets = qw.codes.float() - qw.zero[:, groups].float()
    scale = qw.scale * torch.exp(scaled.theta.detach())
    torch.testing.assert_close(scaled(None).detach(), offsets * scale[:, groups])
    expected = torch.zeros_like(scale).index_add_(1, groups, offsets * grad_out) * scale
    torch.testing.assert_close(scaled.theta.grad, expected)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # as the tuning runs it: still float32
        assert torch.equal(scaled(None), offsets * scale[:, groups])
