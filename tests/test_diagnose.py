"""`specquant diagnose` (toolkit/diagnose/): each section present and consistent on a tiny model, the
recommendation names a measured option, and prefill-heavy vs decode-heavy workloads are told apart."""

import json
import os
import subprocess
import sys

import pytest
import torch

from toolkit.bench.latency import kv_bytes_per_token, weight_bytes_per_token
from toolkit.diagnose import whatifs
from toolkit.diagnose.kv_pressure import kv_pressure
from toolkit.diagnose.recommend import recommend
from toolkit.diagnose.roofline import path_bound, roofline
from toolkit.diagnose.split import dominant, time_split
from toolkit.diagnose.workload import input_stats
from toolkit.engine.generate import generate
from toolkit.engine.precision import cpu_has_native_bf16
from toolkit.engine.setup import load_engine_model
from toolkit.kv import KVSpec, fp_storage
from toolkit.engine.spec import EngineSpec
from toolkit.evaluation.generation import token_agreement
from toolkit.model_state import peek
from toolkit.timing import GenerationTiming

ENGINE = EngineSpec(dtype="fp32", threads=1)


@pytest.fixture(scope="module")
def report(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("diagnose")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "toolkit", "diagnose", f"model={tiny_llama_dir}", "prompts=open",
                          "prompt_tokens=48", "n_prompts=2", "new_tokens=8", "whatifs=all", "engine=fp32",
                          "engine.threads=1", "kv_budget_gib=1", f"out={out / 'd.json'}", f"plot={out / 'd.png'}"],
                         capture_output=True, text=True, env=env, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "d.json").read_text()), run.stdout, out


def test_every_section_is_present_and_printed(report):
    result, stdout, out = report
    for key in ("workload", "split", "dominant", "roofline", "kv_pressure", "whatifs", "recommendation"):
        assert key in result
    for title in ("1. Input", "2. TTFT vs ITL", "3. Bound", "4. KV pressure", "5. What-ifs", "6. Recommendation"):
        assert title in stdout
    assert (out / "d.png").stat().st_size > 1000 and (out / "d.png").read_bytes()[:4] == b"\x89PNG"


def test_shares_sum_to_one_and_tokens_per_char_is_consistent(report):
    result = report[0]
    w = result["workload"]
    assert w["tokens_per_char"] == pytest.approx(w["tokens"] / w["chars"])
    assert 0 <= w["repeated_prefix_share"] < 1
    for split in [result["split"], *result["whatifs"]["rows"].values()]:
        assert split["prefill_share"] + split["decode_share"] == pytest.approx(1)
        assert split["e2e_ms"] > split["ttft_ms"] > 0
    assert result["dominant"] in ("prefill", "decode")


def test_decode_bytes_are_the_weights_plus_the_kv_cache(report, tiny_llama_dir):
    result = report[0]
    model = load_engine_model(str(tiny_llama_dir), ENGINE).model
    decode = result["roofline"]["decode"]
    context = result["prompt_tokens"] + result["new_tokens"] / 2
    assert decode["weight_bytes"] == weight_bytes_per_token(model)
    stored = fp_storage(model, KVSpec())[0] or torch.float32  # kv=fp as one sequence stores it (fp16 on AVX512)
    assert decode["kv_bytes"] == pytest.approx(kv_bytes_per_token(model, stored) * context)
    assert decode["bytes_per_token"] == pytest.approx(decode["weight_bytes"] + decode["kv_bytes"])
    for path in ("prefill", "decode"):
        p = result["roofline"][path]
        assert p["bound"] in ("compute", "memory") and p["flops_per_token"] > 0 and p["times_roofline"] > 0
    kinds = result["kv_pressure"]["kinds"]
    assert kinds["fp"]["bytes_per_sequence"] == kv_bytes_per_token(model, torch.float32) * \
        result["kv_pressure"]["context_tokens"]


def test_every_whatif_was_measured_and_the_recommendation_names_one(report):
    result = report[0]
    rows = result["whatifs"]["rows"]
    # all but bf16 prompt passes, which need fp16-stored weights (engine=fp32 stores fp32), and say so
    assert set(rows) == {"baseline", *whatifs.ALL} - {"bf16-prefill"} == set(result["whatifs"]["measured"])
    notes = result["whatifs"]["notes"]
    assert any(n.startswith("bf16-prefill: skipped, applies to fp16-stored weights") for n in notes)
    assert sorted(result["whatifs"]["ranking"]) == sorted(rows)
    for row in rows.values():
        assert row["runs"] == 2 and row["kl"] >= -1e-6  # a KL estimate: identical logits round to about 0
    # greedy speculative decoding and the prefix cache (here with nothing to reuse) reproduce the baseline's tokens
    assert rows["lookup"]["token_agreement"] == 1.0 and rows["self"]["token_agreement"] == 1.0
    assert "engine.compile=true" in rows["compile"]["command"] and rows["compile"]["kl"] < 1e-3
    assert rows["prefix-cache"]["token_agreement"] == 1.0 and result["whatifs"]["prefix_cache"]["cached_tokens"] == 0
    assert rows["w4"]["kl"] > rows["w8"]["kl"] > 0  # weight quantization measured against the baseline
    rec = result["recommendation"]
    assert rec["option"] in rows and rec["command"].startswith(("specquant", rows[rec["option"]]["apply"]))


def _timing(prompt, ttft, itl, steps):
    return GenerationTiming(prompt, 1, ttft, [itl] * steps)


def test_synthetic_prefill_heavy_and_decode_heavy_workloads_are_classified():
    long_prompt = time_split([_timing(2048, 6.0, 0.02, 31), _timing(2048, 5.0, 0.02, 31)])
    long_output = time_split([_timing(64, 0.05, 0.02, 511)])
    assert dominant(long_prompt) == "prefill" and dominant(long_output) == "decode"
    assert long_output["decode_share"] == pytest.approx(511 * 0.02 / (0.05 + 511 * 0.02))


def test_real_runs_on_the_tiny_model_are_classified(tiny_llama_dir):
    loaded = load_engine_model(str(tiny_llama_dir), ENGINE)
    model, tok = loaded.model, loaded.tokenizer
    prompt = list(range(5, 405))
    heavy_prompt = generate(model, tok, [prompt], 1, stop_tokens=set()).timing  # one token: no decode step at all
    heavy_output = generate(model, tok, [prompt[:4]], 200, stop_tokens=set()).timing
    assert dominant(time_split([heavy_prompt])) == "prefill"
    assert dominant(time_split([heavy_output])) == "decode"


def test_repeated_prefix_share_counts_tokens_an_earlier_prompt_began_with():
    encoded = [[1, 2, 3, 4], [1, 2, 3, 9, 9], [7, 8], [1, 2, 5]]
    stats = input_stats(["abcd", "abcde", "ab", "abc"], encoded)
    assert stats["repeated_prefix_tokens"] == 3 + 0 + 2
    assert stats["repeated_prefix_share"] == pytest.approx(5 / 14)
    assert stats["tokens_per_char"] == pytest.approx(14 / 14)


def test_roofline_bound_follows_the_ridge_point():
    # 100 GFLOP/s, 10 GB/s: ridge 10 FLOP/byte
    compute = path_bound(flops=1e9, bytes_moved=1e6, seconds_per_token=0.02, peak_flops=1e11, bandwidth=1e10)
    memory = path_bound(flops=1e6, bytes_moved=1e8, seconds_per_token=0.02, peak_flops=1e11, bandwidth=1e10)
    assert compute["bound"] == "compute" and compute["times_roofline"] == pytest.approx(1e11 / (1e9 / 0.02))
    assert memory["bound"] == "memory" and memory["times_roofline"] == pytest.approx(0.02 / (1e8 / 1e10))


def test_a_windowed_cache_reads_what_it_holds(tiny_llama_dir):
    model = load_engine_model(str(tiny_llama_dir), ENGINE).model
    split = {"ttft_ms": 100.0, "itl_ms": 10.0}
    full = roofline(model, 1000.0, 8000, 64, split, 1e11, 1e10)["decode"]
    windowed = roofline(model, 1000.0, 8000, 64, split, 1e11, 1e10, held=2308)["decode"]
    assert full["kv_bytes"] == 1000.0 * 8032 and windowed["kv_bytes"] == 1000.0 * 2308
    assert windowed["context_tokens"] == 2308 < full["context_tokens"]


def test_a_quantized_kv_cache_fits_more_long_sequences(tiny_llama_dir):
    model = load_engine_model(str(tiny_llama_dir), ENGINE).model
    kinds = kv_pressure(model, 2048, torch.float32, 2**30)["kinds"]
    assert kinds["fp"]["sequences_in_budget"] < kinds["int8"]["sequences_in_budget"] < \
        kinds["int4"]["sequences_in_budget"]


def test_auto_whatifs_follow_the_diagnosis():
    assert "lookup" in whatifs.choose("auto", "decode", 0.0) and "kv-int8" not in whatifs.choose("auto", "decode", 0.0)
    prefill = whatifs.choose("auto", "prefill", 0.3)
    assert "lookup" not in prefill and {"w8", "kv-int4"} <= set(prefill)
    assert "compile" in whatifs.choose("auto", "decode", 0.0) and "compile" not in prefill
    assert ("bf16-prefill" in prefill) == cpu_has_native_bf16() and "bf16-prefill" not in whatifs.choose("auto",
                                                                                                       "decode", 0.0)
    with pytest.raises(Exception, match="unknown what-if"):
        whatifs.choose(["w3"], "decode", 0.0)


def test_the_bf16_prefill_whatif_runs_a_bf16_prepared_copy_and_says_when_it_does_not_apply(tiny_llama_dir,
                                                                                             monkeypatch):
    import toolkit.engine.precision as precision

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    half = ENGINE.replace(dtype="auto")  # fp16-stored weights, fp32 activations
    loaded = load_engine_model(str(tiny_llama_dir), half)
    options, notes = whatifs.build_options(["bf16-prefill"], loaded.model, str(tiny_llama_dir), half, None, None,
                                           loaded.tokenizer, quantized_input=False)
    assert [o.name for o in options] == ["baseline", "bf16-prefill"] and not notes
    option = options[1]
    assert option.apply == "engine.prefill_dtype=bf16" and peek(option.model).precision.prefill == "bf16"
    assert option.model is not loaded.model and peek(loaded.model).precision.prefill == "fp32"
    ids = loaded.tokenizer("The syntax of a class definition is the same as that of any other compound statement, "
                           "and its body is a suite of statements").input_ids
    whatifs.measure(options, loaded.tokenizer, [ids], new_tokens=4)
    assert all(len(o.timings) == 1 and len(o.outputs[0]) == 4 for o in options)
    from toolkit.diagnose.quality import quality_change, quality_slice

    quality = quality_change(options, quality_slice(loaded.tokenizer, "pydoc", 48, 2), chunk=16)
    assert quality["bf16-prefill"]["scored"] == "measured" and 0 < quality["bf16-prefill"]["kl"] < 0.05
    # already bf16, or no native bf16: a note instead of a row
    _, notes = whatifs.build_options(["bf16-prefill"], option.model, str(tiny_llama_dir), half, None, None,
                                     loaded.tokenizer, quantized_input=False)
    assert notes == ["bf16-prefill: skipped, the baseline already runs bf16 prompt passes"]
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    _, notes = whatifs.build_options(["bf16-prefill"], loaded.model, str(tiny_llama_dir), half, None, None,
                                     loaded.tokenizer, quantized_input=False)
    assert notes[0].startswith("bf16-prefill: skipped, engine.prefill_dtype=bf16 but this CPU has no native bf16")


def _row(ttft, itl, kl):
    return {"ttft_ms": ttft, "itl_ms": itl, "e2e_ms": ttft + 10 * itl, "kl": kl}


def test_recommendation_cuts_the_dominant_metric_within_the_quality_budget():
    rows = {"baseline": _row(100, 10, 0), "w4": _row(90, 5, 0.2), "w8": _row(95, 7, 0.01), "lookup": _row(100, 8, 0)}
    apply = {n: f"cmd {n}" for n in rows}
    rec = recommend(rows, "decode", kl_budget=0.05, min_gain=0.05, apply=apply, base_command="cmd")
    assert rec["option"] == "w8" and rec["command"] == "cmd w8" and rec["gain"] == pytest.approx(0.3)
    rec = recommend(rows, "prefill", kl_budget=0.05, min_gain=0.1, apply=apply, base_command="cmd")
    assert rec["option"] == "baseline" and "no measured option" in rec["why"]


# ---- the prefix-cache what-if ----------------------------------------------------------------------------------

def test_prefix_cache_reuses_earlier_prompts_blocks_and_keeps_the_baselines_tokens(tiny_model):
    from toolkit.diagnose.prefix_cache import BLOCK_SIZE, PrefixCacheRun

    model, tok = tiny_model
    shared = list(range(5, 45))  # 40 tokens: two whole blocks of 16 are reusable, the last 8 are not
    encoded = [shared + [100 + i, 7, 8, 9][: 2 + i] for i in range(3)]
    base = whatifs.Option("baseline", "none", model)
    option = whatifs.Option("prefix-cache", "prefix", model, prefix=PrefixCacheRun(model))
    whatifs.measure([base, option], tok, encoded, new_tokens=6, warmup=1, repeats=2)
    assert option.outputs == base.outputs and token_agreement(option.outputs, base.outputs) == 1.0
    reused = (len(shared) // BLOCK_SIZE) * BLOCK_SIZE
    # each pass starts cold (the warm-up's blocks dropped too): the first prompt finds nothing, later ones the prefix
    assert option.cached_tokens == [0, reused, reused] * 2
    assert input_stats(["x"] * 3, encoded)["repeated_prefix_tokens"] >= 2 * reused
    for timing in option.timings:
        assert timing.ttft_s > 0 and len(timing.itl_s) == 5
    option.prefix.cache.pool.check()
    assert option.prefix.cache.pool.used == 0  # every request gave its blocks back (they stay cached, unreferenced)


def test_auto_whatifs_add_the_prefix_cache_only_where_a_prefix_repeats():
    assert "prefix-cache" in whatifs.choose("auto", "prefill", 0.0, repeated_prefix_share=0.3)
    assert "prefix-cache" not in whatifs.choose("auto", "prefill", 0.0, repeated_prefix_share=0.0)
    assert "prefix-cache" in whatifs.choose("all", "decode", 0.0)


def test_a_recommended_prefix_cache_is_applied_in_the_server_and_says_why():
    rows = {"baseline": _row(100, 10, 0), "prefix-cache": {**_row(20, 10.5, 0.0), "explain": "served"},
            "w8": _row(95, 7, 0.01)}
    apply = {"baseline": "cmd", "w8": "cmd w8", "prefix-cache": "specquant serve model=m prefix_cache=true"}
    rec = recommend(rows, "prefill", kl_budget=0.05, min_gain=0.05, apply=apply, base_command="cmd")
    assert rec["option"] == "prefix-cache" and rec["command"].startswith("specquant serve")
    assert rec["explain"] == "served" and rec["gain"] == pytest.approx(0.8)


@pytest.fixture(scope="module")
def shared_prefix_report(tiny_llama_dir, tmp_path_factory):
    """A workload whose prompts share a long system passage, each with its own short question (a .txt prompt_file:
    one prompt per blank-line separated block)."""
    import pydoc_data.topics

    out = tmp_path_factory.mktemp("diagnose-prefix")
    passage = " ".join(list(pydoc_data.topics.topics.values())[3][:900].split())
    questions = ["What does it say first?", "Summarize it in one line.", "Which keyword matters most?"]
    (out / "prompts.txt").write_text("\n\n".join(f"{passage}\nQuestion: {q}" for q in questions) + "\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "toolkit", "diagnose", f"model={tiny_llama_dir}",
                          f"prompt_file={out / 'prompts.txt'}", "n_prompts=3", "new_tokens=6", "whatifs=auto",
                          "engine=fp32", "engine.threads=1", "kv_budget_gib=1", f"out={out / 'd.json'}"],
                         capture_output=True, text=True, env=env, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "d.json").read_text()), run.stdout


def test_a_repeated_prefix_is_measured_with_the_prefix_cache(shared_prefix_report):
    result, stdout = shared_prefix_report
    w = result["workload"]
    assert w["repeated_prefix_share"] > 0.5  # two of three prompts repeat the long passage
    measured = result["whatifs"]["measured"]
    assert "prefix-cache" in measured  # whatifs=auto chose it
    rows = result["whatifs"]["rows"]
    row = rows["prefix-cache"]
    assert row["token_agreement"] == 1.0 and row["kl"] == 0 and row["knob"] == "prefix" and row["runs"] == 3
    assert row["prefill_share"] + row["decode_share"] == pytest.approx(1) and row["e2e_ms"] > row["ttft_ms"] > 0
    assert row["command"].startswith("specquant serve") and "prefix_cache=true" in row["command"]
    reuse = result["whatifs"]["prefix_cache"]
    assert reuse["cached_per_prompt"][0] == 0 and all(c > 0 for c in reuse["cached_per_prompt"][1:])
    assert 0 < reuse["cached_tokens"] <= w["repeated_prefix_tokens"]
    assert all(c % reuse["block_size"] == 0 for c in reuse["cached_per_prompt"])
    assert "not built" not in stdout and "prefix-cache what-if found" in stdout
    rec = result["recommendation"]
    assert rec["option"] in measured and rec["command"] == rows[rec["option"]]["command"]
    if rec["option"] == "prefix-cache":  # timings are noise-prone on a tiny model: checked only when it wins
        assert rec["explain"] == whatifs.EXPLAIN["prefix"] and "prefix caching lives in the server" in stdout
