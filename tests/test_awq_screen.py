"""The AWQ screen (benchmarks/awq_screen.py): its rounded float model is AWQ's quantized model (the same KL as
`make_quantized_state_dict`'s), the breakdown's ends meet the whole, and variants are parsed and applied."""

import pytest
import torch

from benchmarks import awq_screen

BASE = dict(method="awq", bits=4, group_size=32, symmetric=False, dataset="pydoc", n_samples=4, seq_len=32,
            calib_dtype="fp32", awq_search_samples=2)


def test_variants_parse_as_yaml_types():
    assert awq_screen.parse_variant("") == {}
    assert awq_screen.parse_variant("awq_gqa_v_o=true, quantize.awq_grid=10,awq_max_shrink=0.3") == {
        "awq_gqa_v_o": True, "awq_grid": 10, "awq_max_shrink": 0.3}
    with pytest.raises(ValueError, match="key=value"):
        awq_screen.parse_variant("awq_gqa_v_o")


def test_a_recipe_name_gives_its_model_and_quantize_keys():
    model, keys = awq_screen.load_recipe("gemma3-270m/awq-w4g128")
    assert model == "gemma3-270m" and keys["method"] == "awq" and keys["group_size"] == 128
    _, gptq = awq_screen.load_recipe("smollm2-135m/gptq-w4g64")
    with pytest.raises(ValueError, match="method=gptq"):  # refused before any model loads
        awq_screen.screen("no-such-model", gptq, [""], ["pydoc"])
    # a variant the one float fold cannot stand for (GPTQ's rounding, blocks searched on quantized outputs)
    for variant in ("awq_rounding=gptq", "awq_next_inputs=quantized"):
        with pytest.raises(ValueError, match="specquant quantize and specquant eval"):
            awq_screen.screen("no-such-model", keys, ["", variant], ["pydoc"])


def test_the_screen_measures_awqs_own_quantized_model(tiny_llama_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from toolkit.data import load_text
    from toolkit.evaluation.windows import make_windows
    from toolkit.quant.calibrate import make_quantized_state_dict
    from toolkit.quant.model_quant import QuantRecipe

    lines = []
    out = awq_screen.screen(str(tiny_llama_dir), BASE, ["awq_clip=false", ""], ["pydoc"], windows=2,
                            breakdown=True, report=lines.append, window=64)
    assert len(lines) == 2 + 1 + 7 + 2  # two variants; nothing rounded, every kind alone, every block alone
    plain = out["variants"][""]["pydoc"]
    unclipped = out["variants"]["awq_clip=false"]["pydoc"]
    assert unclipped != plain  # the variant was applied

    def load():
        return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    quantized = load()
    make_quantized_state_dict(quantized, tiny_tokenizer, QuantRecipe(**BASE), progress=False)  # fake-quantized
    windows, _ = make_windows(tiny_tokenizer, load_text("pydoc", "evaluation")["text"], 64, max_windows=2)
    assert awq_screen.KLMeter(load(), {"pydoc": windows})(quantized)["pydoc"] == pytest.approx(plain, rel=1e-5)
    # the breakdown of the unclipped variant: unrounded, its folded model is the float model's function; each piece
    # rounded alone costs something, less than all of them rounded
    parts = {label: kls["pydoc"] for label, kls in out["breakdown"].items()}
    assert parts.pop("nothing rounded") < 1e-6
    assert set(parts) == {f"only {k}" for k in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj")} | {"only block 0", "only block 1"}
    assert all(0 < kl < unclipped for kl in parts.values()), parts
