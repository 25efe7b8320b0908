"""`specquant generate/bench spec=...` end to end (subprocesses, as a user runs them) on the tiny checkpoint."""

import json
import os
import subprocess
import sys


def specquant(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, env=env,
                          timeout=600, check=False)


def test_bench_spec_self_writes_the_documented_figures(tiny_llama_dir, tmp_path):
    out = tmp_path / "b.json"
    run = specquant("bench", f"model={tiny_llama_dir}", "spec=self", "spec.bits=null", "spec.layers=1",
                    "prompts=code", "prompt_tokens=48", "new_tokens=12", "n_prompts=2", "repeats=1", "warmup=0",
                    "engine=fp32", "engine.threads=1", "+store=none", f"out={out}")
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    for key in ("acceptance_rate", "mean_accepted", "speedup_vs_nospec", "identical_outputs", "accepted_histogram"):
        assert key in result
    assert result["identical_outputs"] is True and result["runs"] == 2
    assert 0 <= result["acceptance_rate"] <= 1 and "speedup vs no speculation" in run.stdout


def test_generate_spec_lookup_prints_the_same_text_as_without(tiny_llama_dir, tmp_path):
    common = [f"model={tiny_llama_dir}", "prompt=The syntax of the syntax of", "new_tokens=10", "engine=fp32",
              "engine.threads=1"]
    plain = specquant("generate", *common, f"out={tmp_path / 'a.json'}")
    spec = specquant("generate", *common, "spec=lookup", f"out={tmp_path / 'b.json'}")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a["outputs"][0]["token_ids"] == b["outputs"][0]["token_ids"]
    assert "acceptance" in spec.stderr and "acceptance_rate" in b["timing"]["spec"]


def test_a_missing_draft_model_is_one_clear_error(tiny_llama_dir):
    run = specquant("generate", f"model={tiny_llama_dir}", "spec=draft", "new_tokens=2", "engine=fp32")
    assert run.returncode != 0 and "spec.model" in run.stderr and "Traceback" not in run.stderr


def test_interleaved_warms_each_path_then_alternates_which_goes_first():
    from toolkit.bench.interleave import interleaved

    calls = []
    paths = {"a": lambda ids: calls.append(("warm a", ids)), "b": lambda ids: calls.append(("warm b", ids))}
    order = list(interleaved(paths, ["p0", "p1"], repeats=2, warmup=1))
    assert calls == [("warm a", "p0"), ("warm b", "p0")]
    assert [(rep, name, ids) for rep, name, ids in order] == [
        (0, "a", "p0"), (0, "b", "p0"), (0, "b", "p1"), (0, "a", "p1"),
        (1, "b", "p0"), (1, "a", "p0"), (1, "a", "p1"), (1, "b", "p1")]
