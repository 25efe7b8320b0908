"""Calibration windows and the block-by-block driver (RTN through it must equal quantize_model exactly)."""

import dataclasses
import json

import pytest
import torch

from toolkit.quant.block_passes import decoder_blocks
from toolkit.quant.blockwise import quantize_blockwise
from toolkit.quant.calibration_data import calibration_batches
from toolkit.quant.layer_quantizers import RTNLayerQuantizer
from toolkit.quant.model_quant import QuantRecipe, quantize_model

RECIPE = QuantRecipe(bits=4, group_size=32)
N, L = 4, 32


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def batches(tiny_tokenizer):
    return calibration_batches(tiny_tokenizer, n_samples=N, seq_len=L, seed=0)


def _stream(tokenizer, split):
    from toolkit.data import load_text

    ids = []
    for text in load_text("pydoc", split=split)["text"]:
        if text:
            ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return ids


def _contains(stream, window):
    s, w = torch.tensor(stream), torch.tensor(window)
    hits = (s.unfold(0, len(w), 1) == w).all(1)
    return bool(hits.any())


def test_calibration_batches_deterministic_shape_split(tiny_tokenizer):
    a = calibration_batches(tiny_tokenizer, n_samples=6, seq_len=24, seed=3)
    b = calibration_batches(tiny_tokenizer, n_samples=6, seq_len=24, seed=3)
    c = calibration_batches(tiny_tokenizer, n_samples=6, seq_len=24, seed=4)
    assert a.shape == (6, 24) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    calib = _stream(tiny_tokenizer, "calibration")
    evaluation = _stream(tiny_tokenizer, "evaluation")
    # the tiny tokenizer adds no BOS by default: windows are plain slices of the calibration stream
    assert tiny_tokenizer("a")["input_ids"][0] != tiny_tokenizer.bos_token_id
    for row in a.tolist():
        assert _contains(calib, row)
        assert not _contains(evaluation, row)


def test_calibration_mix_alternates_sources_each_drawn_as_alone(tiny_tokenizer):
    """"pydoc+stdlib-code": window i from source i % 2, each source's windows those it gives calibrated alone, so
    the first windows (AWQ's search samples) hold both kinds of text."""
    mix = calibration_batches(tiny_tokenizer, "pydoc+stdlib-code", n_samples=5, seq_len=24, seed=3)
    prose = calibration_batches(tiny_tokenizer, "pydoc", n_samples=3, seq_len=24, seed=3)
    code = calibration_batches(tiny_tokenizer, "stdlib-code", n_samples=2, seq_len=24, seed=3)
    assert mix.shape == (5, 24)
    assert torch.equal(mix[0::2], prose) and torch.equal(mix[1::2], code)
    assert torch.equal(calibration_batches(tiny_tokenizer, "pydoc+stdlib-code", n_samples=1, seq_len=24, seed=3),
                       prose[:1])
    for bad in ("pydoc+pydoc", "pydoc+", "+pydoc"):
        with pytest.raises(ValueError, match="joined by"):
            calibration_batches(tiny_tokenizer, bad, n_samples=2, seq_len=24)


def test_calibration_batches_bos(tiny_tokenizer):
    bos = tiny_tokenizer.bos_token_id
    with_bos = calibration_batches(tiny_tokenizer, n_samples=3, seq_len=16, add_bos=True)
    assert with_bos.shape == (3, 16) and (with_bos[:, 0] == bos).all()
    without = calibration_batches(tiny_tokenizer, n_samples=3, seq_len=16, add_bos=False)
    assert not (without[:, 0] == bos).all()

    class BosTokenizer:  # a tokenizer that adds BOS by default -> add_bos=None means yes
        bos_token_id, eos_token_id = 7, 8

        def __call__(self, text, add_special_tokens=True):
            ids = [ord(ch) % 50 + 10 for ch in text]
            return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}

    out = calibration_batches(BosTokenizer(), dataset=["hello world " * 20], n_samples=2, seq_len=10)
    assert (out[:, 0] == 7).all() and not (out[:, 1:] == 7).any()


class CountingQuantizer(RTNLayerQuantizer):
    """RTN codes, plus an accumulator that counts the rows (tokens) and calls each layer saw."""

    def __init__(self, config):
        super().__init__(config)
        self.seen = {}

    def accumulator(self, linear):
        class Acc:
            rows = calls = 0

            def add(self, x):
                assert x.shape[-1] == linear.in_features
                self.rows += x.reshape(-1, x.shape[-1]).shape[0]
                self.calls += 1
        return Acc()

    def quantize(self, name, linear, accumulator):
        self.seen[name] = (accumulator.rows, accumulator.calls)
        return super().quantize(name, linear, accumulator)


def _no_hooks(model):
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
        assert "forward" not in module.__dict__


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_blockwise_rtn_equals_quantize_model(arch, tiny_llama_dir, tiny_gemma3_dir, batches):
    path = tiny_llama_dir if arch == "llama" else tiny_gemma3_dir
    reference = quantize_model(_load(path), RECIPE, progress=False)
    model = _load(path)
    quantizer = CountingQuantizer(RECIPE.config)
    qsd = quantize_blockwise(model, RECIPE, batches, quantizer, progress=False)
    assert list(qsd.weights) == list(reference.weights) and len(qsd) > 0
    for name, qw in qsd.weights.items():
        ref = reference[name]
        assert torch.equal(qw.codes, ref.codes) and torch.equal(qw.scale, ref.scale)
        assert torch.equal(qw.zero, ref.zero)
        assert qsd.errors[name] == pytest.approx(reference.errors[name])
        # the model is left fake-quantized
        assert torch.equal(model.get_submodule(name).weight, qw.dequantize(torch.float32))
    assert [s.name for s in qsd.skipped] == [s.name for s in reference.skipped]
    # every layer saw each sample once: n_samples * seq_len rows, in one call (calib_batch=0: one batch of all)
    assert set(quantizer.seen) == set(qsd.weights)
    assert all(v == (N * L, 1) for v in quantizer.seen.values())
    _no_hooks(model)


def test_blockwise_fake_quant_model_runs_and_differs(tiny_gemma3_dir, batches):
    model = _load(tiny_gemma3_dir)
    before = model(input_ids=batches[:1]).logits
    quantize_blockwise(model, RECIPE, batches, RTNLayerQuantizer(RECIPE.config), progress=False)
    after = model(input_ids=batches[:1]).logits
    assert torch.isfinite(after).all() and not torch.equal(before, after)
    _no_hooks(model)


class _Crash(Exception):
    pass


class CrashingQuantizer(RTNLayerQuantizer):
    def __init__(self, config, crash_at=None):
        super().__init__(config)
        self.crash_at, self.quantized = crash_at, []

    def quantize(self, name, linear, accumulator):
        if self.crash_at is not None and name.startswith(self.crash_at):
            raise _Crash(name)
        self.quantized.append(name)
        return super().quantize(name, linear, accumulator)

    def fingerprint(self):
        return super().fingerprint()  # the crash point is not part of the run's identity


def test_resume_after_crash(tiny_gemma3_dir, batches, tmp_path):
    full_model = _load(tiny_gemma3_dir)
    full = quantize_blockwise(full_model, RECIPE, batches, RTNLayerQuantizer(RECIPE.config), progress=False)

    blocks_name, _ = decoder_blocks(full_model)
    state = tmp_path / "state"
    crashed = CrashingQuantizer(RECIPE.config, crash_at=f"{blocks_name}.1.")
    with pytest.raises(_Crash):
        quantize_blockwise(_load(tiny_gemma3_dir), RECIPE, batches, crashed, progress=False, state_dir=state)
    assert json.loads((state / "progress.json").read_text())["blocks_done"] == 1
    assert all(n.startswith(f"{blocks_name}.0.") for n in crashed.quantized) and crashed.quantized

    model = _load(tiny_gemma3_dir)
    resumed_q = CrashingQuantizer(RECIPE.config)
    resumed = quantize_blockwise(model, RECIPE, batches, resumed_q, progress=False, state_dir=state)
    assert resumed_q.quantized and not any(n.startswith(f"{blocks_name}.0.") for n in resumed_q.quantized)
    assert list(resumed.weights) == list(full.weights)
    for name, qw in resumed.weights.items():
        assert torch.equal(qw.codes, full[name].codes) and torch.equal(qw.scale, full[name].scale)
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), full_model.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1  # the same fake-quant model, block 0 restored from disk
    _no_hooks(model)

    # a finished run resumes to the same result without quantizing anything
    again_q = CrashingQuantizer(RECIPE.config)
    again = quantize_blockwise(_load(tiny_gemma3_dir), RECIPE, batches, again_q, progress=False, state_dir=state)
    assert again_q.quantized == [] and list(again.weights) == list(full.weights)

    # a different recipe must not reuse the state
    with pytest.raises(ValueError, match="different run"):
        quantize_blockwise(_load(tiny_gemma3_dir), QuantRecipe(bits=8, group_size=32), batches,
                           RTNLayerQuantizer(QuantRecipe(bits=8, group_size=32).config), progress=False,
                           state_dir=state)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_captured_inputs_match_full_forward(arch, tiny_llama_dir, tiny_gemma3_dir, batches):
    """Block by block on the float model with the captured kwargs reproduces the model's own hidden states
    (checks each block gets its own mask / rotary embeddings: Gemma 3 mixes sliding and full attention)."""
    from toolkit.quant.block_passes import capture_inputs, run_block

    model = _load(tiny_llama_dir if arch == "llama" else tiny_gemma3_dir)
    _, blocks = decoder_blocks(model)
    with torch.no_grad():
        inputs, kwargs = capture_inputs(model, blocks, batches, torch.device("cpu"))
        assert len(inputs) == N and len(kwargs) == len(blocks)
        _no_hooks(model)  # (output_hidden_states below makes transformers install hooks of its own)
        states = [model(input_ids=batches[j:j + 1], output_hidden_states=True).hidden_states for j in range(N)]
        for i, block in enumerate(blocks):
            for j in range(N):
                torch.testing.assert_close(inputs[j], states[j][i])
            if i + 1 < len(blocks):
                inputs = run_block(block, inputs, kwargs[i])


class _RecordingGPTQ:
    """GPTQ that keeps a copy of each layer's Hessian (what the layer's inputs were)."""

    def __init__(self, recipe):
        from toolkit.quant.layer_quantizers import GPTQLayerQuantizer

        self.inner = GPTQLayerQuantizer(recipe)
        self.hessians = {}

    def accumulator(self, linear):
        return self.inner.accumulator(linear)

    def quantize(self, name, linear, accumulator):
        self.hessians[name] = accumulator.hessian.clone()
        return self.inner.quantize(name, linear, accumulator)


@torch.no_grad()
def _logit_error(model, reference, ids):
    return float((model(input_ids=ids).logits - reference).pow(2).mean())


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_true_sequential_changes_later_inputs_and_beats_rtn(arch, tiny_llama_dir, tiny_gemma3_dir, batches):
    path = tiny_llama_dir if arch == "llama" else tiny_gemma3_dir
    runs = {}
    for sequential in (True, False):
        model = _load(path)
        recipe = QuantRecipe(method="gptq", bits=4, group_size=32, symmetric=False, true_sequential=sequential)
        quantizer = _RecordingGPTQ(recipe)
        quantize_blockwise(model, recipe, batches, quantizer, progress=False)
        runs[sequential] = (model, quantizer.hessians)
    seq, par = runs[True][1], runs[False][1]
    block0 = [n for n in seq if ".layers.0." in n]
    name = {n.rsplit(".", 1)[-1]: n for n in block0}
    # q,k,v come first: same float inputs either way; o, gate/up and down see the quantized earlier stages
    assert torch.equal(seq[name["q_proj"]], par[name["q_proj"]])
    for later in ("o_proj", "up_proj", "down_proj"):
        assert not torch.allclose(seq[name[later]], par[name[later]], rtol=1e-5, atol=1e-7), later
    reference_model = _load(path)
    reference = reference_model(input_ids=batches).logits
    rtn_model = _load(path)
    quantize_blockwise(rtn_model, QuantRecipe(bits=4, group_size=32, symmetric=False), batches,
                       RTNLayerQuantizer(QuantRecipe(bits=4, group_size=32, symmetric=False).config), progress=False)
    gptq_err = _logit_error(runs[True][0], reference, batches)
    rtn_err = _logit_error(rtn_model, reference, batches)
    assert gptq_err < 0.8 * rtn_err, (gptq_err, rtn_err)


def test_offloaded_model_calibrates_block_by_block_like_the_in_ram_one(tiny_llama_dir, batches, tmp_path):
    """accelerate with a tiny RAM cap puts most blocks on disk (meta weights); GPTQ still quantizes every layer,
    one onloaded block at a time, to the same codes as in RAM, and the result saves as a checkpoint."""
    from transformers import AutoModelForCausalLM

    from toolkit.quant.layer_quantizers import GPTQLayerQuantizer
    from toolkit.quant.checkpoint import save_quantized
    from toolkit.quant.offload import has_offloaded

    # an offloaded model calibrates in its own fp32: compare with the in-RAM run in fp32 too
    recipe = QuantRecipe(method="gptq", bits=4, group_size=32, symmetric=False, calib_dtype="fp32")
    in_ram = quantize_blockwise(_load(tiny_llama_dir), recipe, batches, GPTQLayerQuantizer(recipe), progress=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, device_map="auto",
                                                 max_memory={"cpu": "100KB"}, offload_folder=str(tmp_path / "off"))
    assert "disk" in set(model.hf_device_map.values()) and has_offloaded(model)
    assert model.model.layers[1].mlp.down_proj.weight.device.type == "meta"
    offloaded = quantize_blockwise(model, recipe, batches, GPTQLayerQuantizer(recipe), progress=False)
    assert set(offloaded.weights) == set(in_ram.weights)
    for name, qw in in_ram.weights.items():
        assert (offloaded.weights[name].codes != qw.codes).float().mean() < 1e-3, name
    assert not has_offloaded(model)  # everything left in float was brought back for saving
    save_quantized(tmp_path / "ckpt", model, offloaded)


def test_layers_sharing_a_hessian_are_solved_together_with_the_separate_codes(tiny_llama_dir, batches):
    from toolkit.quant.layer_quantizers import GPTQLayerQuantizer

    recipe = QuantRecipe(method="gptq", bits=4, group_size=32, symmetric=False, act_order=True)
    solved = {}
    for label, quantizer in (("together", GPTQLayerQuantizer(recipe)), ("separate", _RecordingGPTQ(recipe))):
        solved[label] = quantize_blockwise(_load(tiny_llama_dir), recipe, batches, quantizer, progress=False).weights
    assert hasattr(GPTQLayerQuantizer(recipe), "quantize_together") and not hasattr(_RecordingGPTQ(recipe),
                                                                                    "quantize_together")
    assert solved["together"].keys() == solved["separate"].keys()
    for name, qw in solved["together"].items():
        other = solved["separate"][name]
        assert torch.equal(qw.codes, other.codes), name
        assert torch.equal(qw.scale, other.scale) and torch.equal(qw.zero, other.zero), name
        assert torch.equal(qw.g_idx, other.g_idx), name


def test_bf16_calibration_quantizes_the_fp32_weights_as_well(tiny_llama_dir, batches):
    runs = {}
    reference = _load(tiny_llama_dir)(input_ids=batches).logits
    for dtype in ("fp32", "bf16"):
        from toolkit.quant.layer_quantizers import GPTQLayerQuantizer

        recipe = QuantRecipe(method="gptq", bits=4, group_size=32, symmetric=False, calib_dtype=dtype)
        model = _load(tiny_llama_dir)
        weights = quantize_blockwise(model, recipe, batches, GPTQLayerQuantizer(recipe), progress=False).weights
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the bf16 copies never replace a weight
        for name, qw in weights.items():  # the model holds the fake-quant fp32 weights of what was saved
            assert torch.equal(model.get_submodule(name).weight, qw.dequantize(torch.float32)), name
        runs[dtype] = (weights, _logit_error(model, reference, batches))
    # bf16 activations move codes at rounding boundaries (GPTQ carries each change on), not the solution's quality
    assert runs["fp32"][0].keys() == runs["bf16"][0].keys()
    assert runs["bf16"][1] < 1.25 * runs["fp32"][1], (runs["bf16"][1], runs["fp32"][1])


def test_calibration_dtype_auto_follows_the_hardware(monkeypatch):
    from toolkit import cpu
    from toolkit.quant.layer_quantizers import calibration_dtype

    for native, expected in ((True, torch.bfloat16), (False, None)):
        monkeypatch.setattr(cpu, "native_bf16", lambda native=native: native)
        assert calibration_dtype(QuantRecipe(method="gptq", calib_dtype="auto"), "cpu") is expected
    assert calibration_dtype(QuantRecipe(method="gptq", calib_dtype="bf16"), "cpu") is torch.bfloat16
    assert calibration_dtype(QuantRecipe(method="gptq", calib_dtype="fp32"), "cpu") is None
    with pytest.raises(ValueError, match="calib_dtype"):
        QuantRecipe(method="gptq", calib_dtype="fp16")


class _RTNRecordingHessians(RTNLayerQuantizer):
    """RTN codes (independent of the data, so both schemes quantize identically) plus each layer's Hessian."""

    def __init__(self, config):
        super().__init__(config)
        self.hessians = {}

    def accumulator(self, linear):
        from toolkit.quant.gptq import HessianAccumulator

        return HessianAccumulator(linear.in_features)

    def quantize(self, name, linear, accumulator):
        self.hessians[name] = accumulator.hessian.clone()
        return super().quantize(name, linear, accumulator)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_one_forward_per_block_matches_the_staged_scheme(arch, tiny_llama_dir, tiny_gemma3_dir, batches):
    """calib_batch=0 (all samples in one batch): a true-sequential block is quantized inside ONE forward of the
    full batch (after a one-sample forward that finds which Linears share an input); calib_batch=1 runs a
    partial forward per stage and an outputs pass, per sample. Every layer must see the same inputs (through the
    quantized earlier stages): RTN codes do not depend on the data, so the Hessians must agree to rounding.
    GPTQ: block 0 gets the same codes; later blocks drift where a near-tie flips a code (a tiny random model is
    chaotic), so only the quality is compared there."""
    path = tiny_llama_dir if arch == "llama" else tiny_gemma3_dir
    runs = {}
    for calib_batch in (0, 1):
        model = _load(path)
        recipe = QuantRecipe(bits=4, group_size=32, symmetric=False, calib_batch=calib_batch)
        _, blocks = decoder_blocks(model)
        calls = [[] for _ in blocks]
        handles = [block.register_forward_pre_hook(
            lambda module, args, kwargs, i=i: calls[i].append((args[0] if args else kwargs["hidden_states"]).shape[0]),
            with_kwargs=True) for i, block in enumerate(blocks)]
        quantizer = _RTNRecordingHessians(recipe.config)
        quantize_blockwise(model, recipe, batches, quantizer, progress=False)
        for handle in handles:
            handle.remove()
        runs[calib_batch] = (quantizer.hessians, calls)
    one, staged = runs[0], runs[1]
    # (each list starts with the capture pass's calls, per sample, that stop at the block)
    assert N > 1 and all(c[-2:] == [1, N] and c.count(N) == 1 for c in one[1]), one[1]  # discovery, then all once
    assert all(len(c) >= 3 * N and set(c) == {1} for c in staged[1])  # partial forwards per stage + outputs
    assert one[0].keys() == staged[0].keys() and len(one[0]) == 7 * len(one[1])
    for name, h in one[0].items():
        torch.testing.assert_close(h, staged[0][name], rtol=1e-4, atol=1e-5 * float(h.abs().max()))

    from toolkit.quant.layer_quantizers import GPTQLayerQuantizer

    reference = _load(path)(input_ids=batches).logits.detach()
    gptq = {}
    for calib_batch in (0, 1):
        model = _load(path)
        recipe = QuantRecipe(method="gptq", bits=4, group_size=32, symmetric=False, calib_dtype="fp32",
                             calib_batch=calib_batch)
        gptq[calib_batch] = (quantize_blockwise(model, recipe, batches, GPTQLayerQuantizer(recipe),
                                                progress=False).weights, _logit_error(model, reference, batches))
    for name, qw in gptq[0][0].items():
        if ".layers.0." in name:
            assert torch.equal(qw.codes, gptq[1][0][name].codes), name
    assert gptq[0][1] == pytest.approx(gptq[1][1], rel=0.25)


def test_calib_batch_is_validated():
    with pytest.raises(ValueError, match="calib_batch"):
        QuantRecipe(method="gptq", calib_batch=-1)


def test_staged_forwards_run_a_batch_in_slices(tiny_llama_dir, batches, monkeypatch):
    """The staged path (AWQ; GPTQ with calib_batch > 0) runs each batch of inputs in slices of _FORWARD_SAMPLES
    samples (cache-sized temporaries) and hands back one output per batch, equal to the unsliced forward."""
    import toolkit.quant.block_passes as block_passes
    from toolkit.quant.block_passes import capture_inputs, collect_statistics, run_block

    model = _load(tiny_llama_dir)
    blocks_name, blocks = decoder_blocks(model)
    with torch.no_grad():
        inputs, kwargs = capture_inputs(model, blocks, batches, torch.device("cpu"))
    batch = [torch.cat(inputs)]
    whole = run_block(blocks[0], batch, kwargs[0])
    monkeypatch.setattr(block_passes, "_FORWARD_SAMPLES", 1)
    calls = []
    handle = blocks[0].register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    sliced = run_block(blocks[0], batch, kwargs[0])
    linears = {n: m for n, m in model.named_modules()
               if n.startswith(f"{blocks_name}.0.") and isinstance(m, torch.nn.Linear)}
    quantizer = CountingQuantizer(RECIPE.config)
    outputs = []
    accumulators, _ = collect_statistics(blocks[0], batch, kwargs[0], linears, quantizer, stop_early=False, outputs=outputs)
    handle.remove()
    assert calls == [1] * (2 * N)
    assert len(sliced) == 1 and len(outputs) == 1
    torch.testing.assert_close(sliced[0], whole[0])
    torch.testing.assert_close(outputs[0], whole[0])
    assert all(acc.rows == N * L and acc.calls == N for acc in accumulators.values())


# ------------------------------------------------------------------------ GPTAQ: the float pass

class _RecordingGPTAQ:
    """GPTQ with GPTAQ's float pass, keeping what each layer's accumulator was given as the float inputs."""

    def __init__(self, recipe, crash_at=None):
        from toolkit.quant.layer_quantizers import GPTQLayerQuantizer

        self.inner = GPTQLayerQuantizer(recipe)
        self.needs_float_inputs = True
        self.float_inputs, self.recorded, self.crash_at = {}, {}, crash_at

    def accumulator(self, linear):
        self.inner.float_inputs = self.float_inputs
        return self.inner.accumulator(linear)

    def quantize(self, name, linear, accumulator):
        if self.crash_at is not None and name.startswith(self.crash_at):
            raise _Crash(name)
        self.recorded[name] = accumulator.float_inputs.clone()
        return self.inner.quantize(name, linear, accumulator)

    def fingerprint(self):
        return self.inner.fingerprint()


GPTAQ = QuantRecipe(method="gptq", bits=4, group_size=32, symmetric=False, calib_dtype="fp32", gptaq_alpha=0.5)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("calib_batch", [0, 1])
def test_gptaq_layers_get_the_float_models_own_inputs(arch, calib_batch, tiny_llama_dir, tiny_gemma3_dir, batches):
    """The float pass runs each block unquantized over the float model's hidden states: every layer's recorded
    float inputs are the inputs that layer gets in the untouched float model (hooked on a plain forward), in
    sample order, in the one-forward scheme and the staged one alike."""
    path = tiny_llama_dir if arch == "llama" else tiny_gemma3_dir
    reference = _load(path)
    expected = {}
    handles = [module.register_forward_pre_hook(
        lambda m, args, name=name: expected.setdefault(name, []).append(args[0].reshape(-1, args[0].shape[-1])))
        for name, module in reference.named_modules() if isinstance(module, torch.nn.Linear) and "layers" in name]
    with torch.no_grad():
        for j in range(N):
            reference(input_ids=batches[j:j + 1])
    for handle in handles:
        handle.remove()
    recipe = dataclasses.replace(GPTAQ, calib_batch=calib_batch)
    quantizer = _RecordingGPTAQ(recipe)
    quantize_blockwise(_load(path), recipe, batches, quantizer, progress=False)
    assert quantizer.recorded.keys() == expected.keys()
    for name, rows in quantizer.recorded.items():
        torch.testing.assert_close(rows, torch.cat(expected[name]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_gptaq_brings_the_quantized_model_nearer_the_float_one(arch, tiny_llama_dir, tiny_gemma3_dir, batches):
    """On its calibration tokens, GPTAQ (alpha 1: the full least-squares step) leaves the fake-quant model's
    logits nearer the float model's than plain GPTQ: what the float pass and the cross term are for."""
    from toolkit.quant.layer_quantizers import GPTQLayerQuantizer

    path = tiny_llama_dir if arch == "llama" else tiny_gemma3_dir
    reference = _load(path)(input_ids=batches).logits.detach()
    errs = {}
    for alpha in (0.0, 1.0):
        model = _load(path)
        recipe = dataclasses.replace(GPTAQ, gptaq_alpha=alpha)
        quantize_blockwise(model, recipe, batches, GPTQLayerQuantizer(recipe), progress=False)
        errs[alpha] = _logit_error(model, reference, batches)
        _no_hooks(model)
    assert errs[1.0] < 0.5 * errs[0.0], errs  # measured: 0.245 -> 0.015 (llama), 0.029 -> 0.005 (gemma3)


def test_gptaq_resumes_after_a_crash_with_its_float_stream(tiny_llama_dir, batches, tmp_path):
    """A resumed GPTAQ run reads block i's float inputs back from the state folder next to its quantized-path
    inputs: the same codes as an uninterrupted run."""
    full = quantize_blockwise(_load(tiny_llama_dir), GPTAQ, batches, _RecordingGPTAQ(GPTAQ), progress=False)
    model = _load(tiny_llama_dir)
    blocks_name, blocks = decoder_blocks(model)
    state = tmp_path / "state"
    with pytest.raises(_Crash):
        quantize_blockwise(model, GPTAQ, batches, _RecordingGPTAQ(GPTAQ, crash_at=f"{blocks_name}.1."),
                           progress=False, state_dir=state)
    assert (state / "float_inputs_0001.pt").exists() and len(blocks) >= 2
    resumed_q = _RecordingGPTAQ(GPTAQ)
    resumed = quantize_blockwise(_load(tiny_llama_dir), GPTAQ, batches, resumed_q, progress=False, state_dir=state)
    assert not any(n.startswith(f"{blocks_name}.0.") for n in resumed_q.recorded)
    assert list(resumed.weights) == list(full.weights)
    for name, qw in resumed.weights.items():
        assert torch.equal(qw.codes, full[name].codes) and torch.equal(qw.scale, full[name].scale), name
    assert not list(state.glob("float_inputs_0001.pt"))  # consumed like inputs_0001.pt


def test_gptaq_alpha_is_validated():
    with pytest.raises(ValueError, match="gptaq_alpha must be >= 0"):
        QuantRecipe(method="gptq", gptaq_alpha=-0.1)
    for method in ("awq", "rtn"):
        with pytest.raises(ValueError, match="applies to method=gptq"):
            QuantRecipe(method=method, gptaq_alpha=0.25)
    with pytest.raises(ValueError, match="needs true_sequential"):
        QuantRecipe(method="gptq", gptaq_alpha=0.25, true_sequential=False)

