"""llama.cpp as a bench baseline (toolkit/bench/llamacpp.py): the type nearest the engine's weights, a clear
"unavailable" in the result where llama-cpp-python is not built, and -- where it is, with the real SmolLM2 --
a row measured on the same prompts beside the engine's."""

import pytest
from hydra import compose, initialize_config_dir

from toolkit.bench import llamacpp
from toolkit.cli.app import CONF_DIR


def test_the_type_follows_the_engines_weight_bits():
    assert [llamacpp.nearest_type(b) for b in (None, 8, 4, 3)] == ["F16", "Q8_0", "Q4_0", "Q4_0"]


def _bench(model: str, baseline: str, tmp_path):
    from toolkit.cli.bench import run

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("bench", overrides=[f"model.name={model}", f"baseline={baseline}", "prompts=open",
                                          "prompt_tokens=24", "new_tokens=4", "n_prompts=1", "repeats=1",
                                          "warmup=0", f"out={tmp_path / 'b.json'}", "+store=none"])
    return run(cfg)


def test_without_llama_cpp_the_result_says_so_and_the_engine_row_stands(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp, "unavailable", lambda: "llama-cpp-python is not installed (test)")
    result = _bench(str(tiny_llama_dir), "llamacpp", tmp_path)
    assert result["llamacpp"] == {"unavailable": "llama-cpp-python is not installed (test)"}
    assert result["decode_tokens_per_s"] > 0 and "baseline" not in result


def test_an_unknown_baseline_is_a_clear_error(tiny_llama_dir, tmp_path):
    from toolkit.errors import InputError

    with pytest.raises(InputError, match="hf,llamacpp"):
        _bench(str(tiny_llama_dir), "vllm", tmp_path)


@pytest.mark.real_model
def test_llama_cpp_runs_beside_the_engine_on_the_same_prompts(smollm2, tmp_path):
    if llamacpp.unavailable():
        pytest.skip(llamacpp.unavailable())
    result = _bench("smollm2-135m", "llamacpp", tmp_path)
    peer = result["llamacpp"]
    assert peer["dtype"] == "llama.cpp F16, same weights" and peer["weights"] == "same weights"  # our export
    assert peer["new_tokens"] == 4 and peer["decode_tokens_per_s"] > 0
    assert 0 <= result["greedy_token_agreement_vs_llamacpp"] <= 1 and result["speedup_vs_llamacpp"] > 0
