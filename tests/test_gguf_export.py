"""`specquant export format=gguf` (toolkit/quant/formats/gguf_export.py): the GGUF blocks dequantize (gguf-py's
reader) to specquant's own dequantized weights within fp16 rounding of the block constants; grids llama.cpp has no
block for are requantized and say so; llama.cpp (where llama-cpp-python is built) runs the files."""

import gguf
import numpy as np
import pytest
import torch

from toolkit.quant.checkpoint import load_quantized, save_quantized
from toolkit.quant.formats.gguf_export import (
    REQUANTIZED,
    SAME,
    _permute,
    exact_blocks,
    export_gguf,
)
from toolkit.quant.model_quant import QuantRecipe, quantize_model
from toolkit.quant.primitives import QuantConfig
from toolkit.quant.rtn import rtn_quantize

HEADS, KV_HEADS = 4, 2  # the tiny llama's (tests/conftest.py)
ULP = 2.0 ** -11  # fp16's relative rounding


def _llama_cpp_missing():
    from toolkit.bench.llamacpp import unavailable

    return unavailable()


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def _checkpoint(llama, tiny_llama_dir, tmp_path, **recipe):
    from transformers import AutoTokenizer

    qsd = quantize_model(llama, QuantRecipe(**recipe), progress=False)
    return save_quantized(tmp_path / "ck", llama, qsd, AutoTokenizer.from_pretrained(tiny_llama_dir),
                          source=str(tiny_llama_dir))


def _tensors(path):
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def _gguf_row_order(name, t):
    if ".attn_q." in name:
        return _permute(t, HEADS)
    if ".attn_k." in name:
        return _permute(t, KV_HEADS)
    return t


def _field(path, key):
    fld = gguf.GGUFReader(path).fields.get(key)
    return None if fld is None else fld.contents()


@pytest.mark.parametrize("bits,group_size,symmetric,gtype", [(4, 32, True, "Q4_0"), (4, 64, False, "Q4_1"),
                                                             (3, 32, True, "Q4_0"), (8, -1, True, "Q8_0")])
def test_a_grid_llama_cpp_has_is_written_as_is(llama, tiny_llama_dir, tmp_path, bits, group_size, symmetric, gtype):
    ck = _checkpoint(llama, tiny_llama_dir, tmp_path, bits=bits, group_size=group_size, symmetric=symmetric)
    result = export_gguf(ck, tmp_path / "m.gguf")
    assert result.exact and result.weights == SAME and result.main_type == gtype
    assert _field(result.path, "specquant.weights") == SAME and _field(result.path, "specquant.exact") is True
    _, qsd, _ = load_quantized(ck)
    tensors = _tensors(result.path)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "mlp.down_proj": "ffn_down",
             "mlp.up_proj": "ffn_up"}
    worst = 0.0
    for layer in (0, 1):
        for ours, theirs in names.items():
            qw = qsd.weights[f"model.layers.{layer}.{ours}"]
            t = tensors[f"blk.{layer}.{theirs}.weight"]
            assert t.tensor_type.name == gtype
            value = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(qw.out_features, -1).copy())
            want = _gguf_row_order(t.name, qw.dequantize())
            # the bound: fp16 rounding of d (and of m = -d * z) on each code's distance from the zero point
            groups = qw.group_index()
            scale = _gguf_row_order(t.name, qw.scale[:, groups])
            codes, zero = _gguf_row_order(t.name, qw.codes.float()), _gguf_row_order(t.name, qw.zero[:, groups].float())
            reach = codes + zero if gtype == "Q4_1" else (codes - zero).abs()
            assert bool(((value - want).abs() <= scale * ULP * reach + 1e-7).all()), t.name
            worst = max(worst, float((value - want).abs().max()))
    assert 0 < worst < 1e-2
    assert result.max_abs_diff()[gtype] >= worst * 0.999


def test_a_grid_without_a_llama_cpp_block_is_requantized_and_says_so(llama, tiny_llama_dir, tmp_path):
    # asymmetric 8-bit: q - z spans more than int8, so Q8_0 cannot hold the grid
    ck = _checkpoint(llama, tiny_llama_dir, tmp_path, bits=8, group_size=-1, symmetric=False)
    result = export_gguf(ck, tmp_path / "m.gguf")
    assert not result.exact and result.weights == REQUANTIZED and result.main_type == "Q8_0"
    assert "blk.0.attn_q.weight" in result.requantized
    assert _field(result.path, "specquant.exact") is False
    assert _field(result.path, "specquant.weights") == REQUANTIZED
    assert "blk.0.attn_q.weight" in _field(result.path, "specquant.requantized")
    # asking another type than the grid's own (an asymmetric grid as Q4_0) is requantizing too
    ck4 = _checkpoint(llama, tiny_llama_dir, tmp_path / "4", bits=4, group_size=32, symmetric=False)
    assert export_gguf(ck4, tmp_path / "m4.gguf", "q4_0").weights == REQUANTIZED


def test_act_order_groups_that_straddle_a_block_do_not_map():
    torch.manual_seed(0)
    config = QuantConfig(bits=4, group_size=32, symmetric=True)
    w = torch.randn(8, 64)
    plain = rtn_quantize(w, config)
    assert exact_blocks(plain, "Q4_0") is not None
    shuffled = rtn_quantize(w, config)
    shuffled.g_idx = torch.randperm(64) // 32  # columns of both groups inside each 32-block
    assert exact_blocks(shuffled, "Q4_0") is None


def test_a_float_export_holds_the_float_weights(llama, tiny_llama_dir, tmp_path):
    result = export_gguf(tiny_llama_dir, tmp_path / "f32.gguf", "f32")
    assert result.exact and result.max_abs_diff() == {"F32": 0.0}
    tensors = _tensors(result.path)
    assert "output.weight" not in tensors  # tied: llama.cpp uses token_embd
    for key, gname in (("model.layers.1.self_attn.k_proj.weight", "blk.1.attn_k.weight"),
                       ("model.layers.0.mlp.gate_proj.weight", "blk.0.ffn_gate.weight"),
                       ("model.embed_tokens.weight", "token_embd.weight")):
        got = np.asarray(tensors[gname].data).reshape(llama.state_dict()[key].shape)
        assert np.array_equal(got, _gguf_row_order(gname, llama.state_dict()[key]).numpy())
    f16 = export_gguf(tiny_llama_dir, tmp_path / "f16.gguf")  # auto: F16
    assert f16.main_type == "F16" and 0 < f16.max_abs_diff()["F16"] < 1e-3


def test_the_cli_writes_a_gguf(llama, tiny_llama_dir, tmp_path):
    from hydra import compose, initialize_config_dir

    from toolkit.cli.app import CONF_DIR
    from toolkit.cli.export import run

    ck = _checkpoint(llama, tiny_llama_dir, tmp_path, bits=4, group_size=32, symmetric=True)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("export", overrides=[f"model.name={ck}", "format=gguf", f"out={tmp_path / 'x.gguf'}"])
    assert run(cfg) == tmp_path / "x.gguf" and _field(tmp_path / "x.gguf", "specquant.weights") == SAME


def _greedy_llama_cpp(path, ids, n):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=2, verbose=False)
    out = []
    for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if len(out) == n:
            return out
    return out


def test_llama_cpp_runs_the_exports_and_agrees_with_fp32(llama, tiny_llama_dir, tmp_path):
    missing = _llama_cpp_missing()
    if missing:
        pytest.skip(f"llama.cpp check skipped: {missing}")
    ids = [1, 40, 77, 120, 5, 300, 9]
    ours = llama.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(ids):]
    f32 = export_gguf(tiny_llama_dir, tmp_path / "f32.gguf", "f32")
    assert _greedy_llama_cpp(f32.path, ids, 8) == ours.tolist()
    ck = _checkpoint(llama, tiny_llama_dir, tmp_path, bits=4, group_size=32, symmetric=True)
    q4 = export_gguf(ck, tmp_path / "q4.gguf")
    assert q4.main_type == "Q4_0" and len(_greedy_llama_cpp(q4.path, ids, 8)) == 8


@pytest.mark.real_model
def test_smollm2_export_has_the_shipped_gguf_layout(smollm2, tmp_path):
    """Every tensor of an F32 export equals the registry GGUF's dequantized tensor (the float model was converted
    from it): names, shapes, llama's q/k permutation and the metadata are llama.cpp's."""
    from toolkit.quant.formats.gguf_export import template_gguf

    result = export_gguf("smollm2-135m", tmp_path / "s.gguf", "f32")
    shipped = gguf.GGUFReader(template_gguf("smollm2-135m"))
    ours = _tensors(result.path)
    assert [t.name for t in shipped.tensors] == list(ours)
    for t in shipped.tensors:
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)
        assert np.array_equal(np.asarray(ours[t.name].data).reshape(-1), want), t.name
    assert _field(result.path, "tokenizer.ggml.pre") == "smollm"
    if not _llama_cpp_missing():
        ids = smollm2.tokenizer("The capital of France is").input_ids
        want = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):]
        assert _greedy_llama_cpp(result.path, ids, 8) == want.tolist()
