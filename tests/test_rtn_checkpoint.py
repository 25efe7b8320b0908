"""RTN, whole-model quantization and quantized checkpoints on tiny random models (offline, seconds)."""

import json
import os

import pytest
import torch
from torch import nn

from toolkit.errors import ModelError
from toolkit.quant import checkpoint as ckpt
from toolkit.quant.checkpoint import TENSORS, is_quantized_checkpoint, load_quantized, save_quantized
from toolkit.quant.model_quant import (
    QuantizedStateDict,
    QuantRecipe,
    quantizable_linears,
    quantize_model,
    swap_quantized_modules,
)
from toolkit.quant.primitives import QuantConfig, choose_qparams, quantize
from toolkit.quant.rtn import rtn_quantize

LINEARS_PER_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def _dequant_linear(qw):
    """A stand-in for QuantLinear.from_quantized: a plain Linear holding the dequantized weight."""
    linear = nn.Linear(qw.in_features, qw.out_features, bias=qw.bias is not None)
    with torch.no_grad():
        linear.weight.copy_(qw.dequantize())
        if qw.bias is not None:
            linear.bias.copy_(qw.bias)
    return linear


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _rel(a, b):
    return float((a - b).norm() / b.norm())


# ------------------------------------------------------------------------------------------------ RTN


@pytest.mark.parametrize("bits,group_size,symmetric", [(4, 32, False), (4, 64, True), (8, -1, True),
                                                        (3, 32, False), (2, -1, False)])
def test_rtn_is_quantize_of_choose_qparams_and_within_half_a_step(bits, group_size, symmetric):
    torch.manual_seed(bits)
    weight = torch.randn(48, 128) * torch.rand(48, 1) * 3
    weight[0, :32] = 0.0  # an all-zero group
    bias = torch.randn(48)
    config = QuantConfig(bits, group_size, symmetric)
    qw = rtn_quantize(weight, config, bias)
    scale, zero = choose_qparams(weight, config)
    assert torch.equal(qw.scale, scale) and torch.equal(qw.zero, zero)
    assert torch.equal(qw.codes, quantize(weight, scale, zero, config))
    assert qw.codes.dtype == torch.uint8 and qw.zero.dtype == torch.int32 and qw.config == config
    assert torch.equal(qw.bias, bias) and qw.bias is not bias
    step = scale[:, qw.group_index()]  # [out, in]
    eps = torch.finfo(torch.float32).eps  # w / scale and (q - zero) * scale each round once in float32
    assert ((weight - qw.dequantize()).abs() <= step / 2 + 2 * eps * (weight.abs() + step)).all()


def test_rtn_keeps_no_bias():
    qw = rtn_quantize(torch.randn(8, 32), QuantConfig(4, 32))
    assert qw.bias is None and qw.g_idx is None


# ----------------------------------------------------------------------------------------------- recipe


def test_recipe_validates():
    with pytest.raises(ValueError, match="rtn"):
        QuantRecipe(method="gptqq")
    with pytest.raises(ValueError, match="bits"):
        QuantRecipe(bits=5)
    with pytest.raises(ValueError, match="group_size"):
        QuantRecipe(group_size=48)
    recipe = QuantRecipe(skip=["mlp.*"], modules="self_attn.*")
    assert recipe.skip == ("mlp.*",) and recipe.modules == ("self_attn.*",)
    assert QuantRecipe.from_dict(recipe.to_dict()) == recipe
    assert json.loads(json.dumps(recipe.to_dict())) == recipe.to_dict()


# ---------------------------------------------------------------------------------------- model quant


def test_quantize_model_covers_every_decoder_linear_and_skips_the_head(llama):
    before = {k: v.clone() for k, v in llama.state_dict().items()}
    qsd = quantize_model(llama, QuantRecipe(bits=4, group_size=32, symmetric=False), progress=False)
    n_layers = llama.config.num_hidden_layers
    expected = {f"model.layers.{i}.{suffix}" for i in range(n_layers) for suffix in LINEARS_PER_LAYER}
    assert set(qsd.weights) == expected and len(qsd) == 7 * n_layers
    assert [s.name for s in qsd.skipped] == ["lm_head"]
    assert "output head" in qsd.skipped[0].reason
    for name, qw in qsd.weights.items():
        linear = llama.get_submodule(name)
        assert qw.codes.shape == linear.weight.shape
        assert 0 < qsd.errors[name] < 0.2
    # the model is not modified
    assert all(isinstance(llama.get_submodule(n), nn.Linear) for n in expected)
    assert all(torch.equal(v, before[k]) for k, v in llama.state_dict().items())


def test_skip_and_modules_patterns(llama):
    recipe = QuantRecipe(group_size=32, skip=("mlp.down_proj",), modules=("model.layers.0.*",))
    linears, skipped = quantizable_linears(llama, recipe)
    assert set(linears) == {f"model.layers.0.{s}" for s in LINEARS_PER_LAYER if s != "mlp.down_proj"}
    reasons = dict(skipped)
    assert "skip pattern 'mlp.down_proj'" in reasons["model.layers.0.mlp.down_proj"]
    assert "none of the recipe's modules" in reasons["model.layers.1.self_attn.q_proj"]
    n_linear = sum(isinstance(m, nn.Linear) for m in llama.modules())
    assert len(linears) + len(skipped) == n_linear  # every Linear is accounted for once


def test_ragged_width_is_quantized_with_a_short_last_group(llama):
    # hidden 64 does not divide by 128: those layers get one group of 64 (the zero-padded group's qparams)
    qsd = quantize_model(llama, QuantRecipe(group_size=128), progress=False)
    q_proj = qsd.weights["model.layers.0.self_attn.q_proj"]
    assert q_proj.scale.shape == (q_proj.out_features, 1) and q_proj.in_features == 64
    assert not qsd.skipped or all("group" not in s.reason for s in qsd.skipped)


def test_odd_layer_in_custom_model_is_quantized_with_a_ragged_group():
    model = nn.Sequential()
    model.add_module("a", nn.Linear(64, 96))
    model.add_module("b", nn.Linear(96, 64))  # 96 % 64 != 0: groups of 64 and 32
    qsd = quantize_model(model, QuantRecipe(group_size=64), progress=False)
    assert list(qsd.weights) == ["a", "b"] and qsd.weights["b"].scale.shape == (64, 2)


# ----------------------------------------------------------------------------------------- checkpoint


@pytest.fixture(scope="module")
def saved(llama, tiny_tokenizer, tmp_path_factory):
    qsd = quantize_model(llama, QuantRecipe(bits=4, group_size=32, symmetric=False), progress=False)
    out = tmp_path_factory.mktemp("ckpt") / "tiny-rtn-int4"
    save_quantized(out, llama, qsd, tokenizer=tiny_tokenizer, source="tiny-llama")
    return out, qsd


def test_save_writes_the_documented_layout(saved, llama):
    from safetensors import safe_open

    out, qsd = saved
    assert is_quantized_checkpoint(out) and not is_quantized_checkpoint(out.parent)
    manifest = json.loads((out / ckpt.MANIFEST).read_text())
    assert manifest["format_version"] == 1 and manifest["source"] == "tiny-llama"
    assert manifest["recipe"]["method"] == "rtn" and manifest["skipped"][0]["name"] == "lm_head"
    assert {"config.json", TENSORS, "tokenizer.json"} <= set(manifest["files"])
    assert manifest["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}  # tied: saved once
    record = manifest["modules"]["model.layers.0.mlp.gate_proj"]
    assert record == {**record, "bits": 4, "group_size": 32, "shape": [128, 64], "codes": "int4_rows"}
    with safe_open(out / TENSORS, "pt") as f:
        keys = set(f.keys())
        codes = f.get_tensor("model.layers.0.mlp.gate_proj.codes")
    assert codes.dtype == torch.uint8 and tuple(codes.shape) == (128, 32)  # two codes per byte
    assert "model.layers.0.mlp.gate_proj.weight" not in keys and "lm_head.weight" not in keys
    assert "model.embed_tokens.weight" in keys and "model.norm.weight" in keys
    assert not list(out.parent.glob(".tmp-*"))


def test_round_trip_is_exact(saved, llama):
    out, qsd = saved
    model, loaded, tokenizer = load_quantized(out)
    assert tokenizer is not None and tokenizer.padding_side == "left"
    assert loaded.recipe == qsd.recipe and loaded.skipped == qsd.skipped
    assert loaded.errors == pytest.approx(qsd.errors)
    assert set(loaded.weights) == set(qsd.weights)
    for name, qw in qsd.weights.items():
        got = loaded[name]
        assert got.config == qw.config
        for field in ("codes", "scale", "zero"):
            a, b = getattr(got, field), getattr(qw, field)
            assert a.dtype == b.dtype and torch.equal(a, b), (name, field)
        assert got.bias is None and qw.bias is None and got.g_idx is None
        assert model.get_submodule(name).weight.device.type == "meta"
    original = llama.state_dict()
    for key, value in model.state_dict().items():
        if key.removesuffix(".weight") not in qsd.weights:
            assert torch.equal(value, original[key]), key
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_round_trip_with_bias_g_idx_and_8_bits(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).eval()  # q/k/v projections have a bias
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.normal_()
    qsd = quantize_model(model, QuantRecipe(bits=8, group_size=32, symmetric=True), progress=False)
    # act-order-style g_idx on one layer: a permutation of the default groups
    qw = qsd.weights["model.layers.0.mlp.up_proj"]
    qw.g_idx = qw.group_index()[torch.randperm(qw.in_features)].to(torch.int32)
    save_quantized(tmp_path / "q", model, qsd)
    loaded_model, loaded, tokenizer = load_quantized(tmp_path / "q")
    assert tokenizer is None
    assert json.loads((tmp_path / "q" / ckpt.MANIFEST).read_text())["aliases"] == {}
    for name, qw in qsd.weights.items():
        got = loaded[name]
        for field in ("codes", "scale", "zero", "bias", "g_idx"):
            a, b = getattr(got, field), getattr(qw, field)
            assert (a is None and b is None) or torch.equal(a, b), (name, field)
    assert loaded["model.layers.0.self_attn.q_proj"].bias is not None
    assert torch.equal(loaded_model.lm_head.weight, model.lm_head.weight)


def test_existing_dir_needs_force(saved, llama):
    out, qsd = saved
    with pytest.raises(ModelError, match="already exists"):
        save_quantized(out, llama, qsd)


def test_truncated_tensors_file_is_reported(saved, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(saved[0], out)
    data = (out / TENSORS).read_bytes()
    (out / TENSORS).write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match=TENSORS) as info:
        load_quantized(out)
    assert "truncated" in info.value.problem and "specquant quantize model=tiny-llama" in info.value.fix


def test_corrupt_tensors_file_is_reported(saved, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(saved[0], out)
    with open(out / TENSORS, "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"\xff" * 10)
    with pytest.raises(ModelError, match=f"{TENSORS} does not match its recorded xxh3_128"):
        load_quantized(out)


def test_failure_mid_save_leaves_nothing(llama, tiny_tokenizer, tmp_path, monkeypatch):
    qsd = quantize_model(llama, QuantRecipe(group_size=32), progress=False)

    def boom(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt, "write_json_atomic", boom)  # the manifest, the last file written
    with pytest.raises(OSError, match="simulated"):
        save_quantized(tmp_path / "q", llama, qsd, tokenizer=tiny_tokenizer)
    assert list(tmp_path.iterdir()) == []


def test_wrong_model_config_is_an_error(saved, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(saved[0], out)
    manifest = json.loads((out / ckpt.MANIFEST).read_text())
    manifest["modules"]["model.layers.0.mlp.nonexistent"] = manifest["modules"]["model.layers.0.mlp.up_proj"]
    (out / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ModelError, match="not in the model"):
        load_quantized(out)


def test_a_manifest_of_an_older_version_still_loads(saved, tmp_path):
    """Older versions recorded the recipe flat: a key since retired (block_size) and the experimental ones at the
    top level. Such a checkpoint still loads."""
    import shutil

    out = tmp_path / "old"
    shutil.copytree(saved[0], out)
    manifest = json.loads((out / ckpt.MANIFEST).read_text())
    recipe = manifest["recipe"]
    recipe.update(recipe.pop("experimental"), block_size=128, awq_clip_grid=5)
    (out / ckpt.MANIFEST).write_text(json.dumps(manifest))
    _, qsd, _ = load_quantized(out)
    assert qsd.recipe.method == "rtn" and qsd.recipe.experimental.awq_clip_grid == 5
    assert QuantRecipe.from_dict(qsd.recipe.to_dict()) == qsd.recipe
    with pytest.raises(ValueError, match="block_size"):  # where a key must mean something, it is refused
        QuantRecipe.from_dict(recipe, retired_ok=False)


# ------------------------------------------------------------------------------------------------ swap


@pytest.fixture(scope="module")
def llama_002():
    """A tiny llama with weights at a trained model's scale (std 0.02). The conftest model's std 0.2 makes a
    chaotic random network that amplifies any weight error (4-bit logits drift ~35% there)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.02,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("bits,group_size,tolerance", [(4, 32, 0.15), (8, -1, 0.02)])
def test_swap_dequantized_gives_close_logits(llama_002, tmp_path, bits, group_size, tolerance):
    import copy

    model = llama_002
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = _logits(model, ids)
    qsd = quantize_model(model, QuantRecipe(bits=bits, group_size=group_size, symmetric=bits == 8),
                         progress=False)
    in_memory = _logits(swap_quantized_modules(copy.deepcopy(model), qsd, _dequant_linear), ids)
    save_quantized(tmp_path / "q", model, qsd)
    loaded_model, loaded, _ = load_quantized(tmp_path / "q")
    swap_quantized_modules(loaded_model, loaded, _dequant_linear)
    assert all(p.device.type == "cpu" for p in loaded_model.parameters())
    logits = _logits(loaded_model, ids)
    assert torch.equal(logits, in_memory)  # the checkpoint changes nothing
    assert 0 < _rel(logits, reference) < tolerance


def test_swap_on_the_chaotic_fixture_model_matches_in_memory(saved, llama):
    import copy

    out, qsd = saved
    ids = torch.randint(0, llama.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    in_memory = _logits(swap_quantized_modules(copy.deepcopy(llama), qsd, _dequant_linear), ids)
    model, loaded, _ = load_quantized(out)
    assert torch.equal(_logits(swap_quantized_modules(model, loaded, _dequant_linear), ids), in_memory)


def test_swap_checks_targets_before_changing_anything(llama):
    import copy

    model = copy.deepcopy(llama)
    qsd = quantize_model(model, QuantRecipe(group_size=32), progress=False)
    bad = QuantizedStateDict(weights={**qsd.weights, "model.layers.0.mlp.missing": qsd.weights[
        "model.layers.0.mlp.up_proj"]}, recipe=qsd.recipe)
    with pytest.raises(ValueError, match="no module"):
        swap_quantized_modules(model, bad, _dequant_linear)
    assert all(isinstance(m, nn.Linear) for n, m in model.named_modules() if n.endswith("_proj"))
    swap_quantized_modules(model, qsd, lambda qw: nn.Identity())
    assert all(isinstance(model.get_submodule(n), nn.Identity) for n in qsd.weights)


def test_gemma3_round_trip_matches_in_memory(tiny_gemma3_dir, tmp_path):
    import copy

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32).eval()
    qsd = quantize_model(model, QuantRecipe(bits=4, group_size=32, symmetric=False), progress=False)
    assert len(qsd) == 7 * model.config.num_hidden_layers and [n for n, _ in qsd.skipped] == ["lm_head"]
    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    in_memory = _logits(swap_quantized_modules(copy.deepcopy(model), qsd, _dequant_linear), ids)
    save_quantized(tmp_path / "q", model, qsd, source=str(tiny_gemma3_dir))
    loaded_model, loaded, _ = load_quantized(tmp_path / "q")
    assert type(loaded_model) is type(model)
    assert torch.equal(_logits(swap_quantized_modules(loaded_model, loaded, _dequant_linear), ids), in_memory)
