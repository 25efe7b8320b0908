"""The `specquant` command end to end (subprocesses, as a user runs it) on the tiny checkpoint."""

import json
import os
import subprocess
import sys

import pytest

from toolkit.cli.app import translate_argv
from toolkit.errors import SpecquantError


def specquant(*args, env=None, cwd=None):
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, env=full_env,
                          cwd=cwd, timeout=600)


def test_positional_words_become_overrides():
    assert translate_argv("models", ["fetch", "gemma3-270m", "force=true"]) == [
        "action=fetch", "force=true", "model=gemma3-270m"]
    assert translate_argv("models", ["list"]) == ["action=list"]
    assert translate_argv("data", ["fetch", "/tmp/x.txt"]) == ["action=fetch", "data.name=/tmp/x.txt"]
    assert translate_argv("generate", ["model=/some/dir", "engine=fp32"]) == ["model.name=/some/dir", "engine=fp32"]
    assert translate_argv("bench", ["-m", "model=smollm2-135m,gemma3-270m"]) == ["-m", "model=smollm2-135m,gemma3-270m"]
    assert translate_argv("eval", ["-m", "model=smollm2-135m,/c/x"]) == ["-m", "model.name=smollm2-135m,/c/x"]
    # two baselines are one value (the docs' `baseline=hf,llamacpp`), which hydra would read as a sweep
    assert translate_argv("bench", ["baseline=hf,llamacpp"]) == ["baseline='hf,llamacpp'"]
    assert translate_argv("bench", ["baseline='hf,llamacpp'"]) == ["baseline='hf,llamacpp'"]
    with pytest.raises(SpecquantError, match="unexpected argument"):
        translate_argv("generate", ["hello"])


def test_help_lists_commands_groups_and_options():
    top = specquant("--help")
    assert top.returncode == 0 and all(c in top.stdout for c in ("generate", "bench", "models", "data", "demo"))
    bench = specquant("bench", "--help")
    assert bench.returncode == 0
    for text in ("model: ", "engine: ", "smollm2-135m", "prompt_tokens", "new_tokens", "out:"):
        assert text in bench.stdout


def test_generate_on_a_local_checkpoint_streams_and_writes_json(tiny_llama_dir, tmp_path):
    out = tmp_path / "g.json"
    run = specquant("generate", f"model={tiny_llama_dir}", "prompt=The syntax of", "new_tokens=6", "engine=fp32",
                    f"out={out}")
    assert run.returncode == 0, run.stderr
    record = json.loads(out.read_text())
    assert record["outputs"][0]["prompt"] == "The syntax of"
    assert run.stdout.startswith("The syntax of" + record["outputs"][0]["text"])
    assert record["timing"]["new_tokens"] <= 6 and "TTFT" in run.stderr


def test_bench_writes_the_documented_json(tiny_llama_dir, tmp_path):
    out = tmp_path / "b.json"
    run = specquant("bench", f"model={tiny_llama_dir}", "prompts=open", "prompt_tokens=32", "new_tokens=8",
                    "n_prompts=2", "repeats=1", f"out={out}")
    assert run.returncode == 0, run.stderr
    r = json.loads(out.read_text())
    keys = {"model", "dtype", "prompt_tokens", "new_tokens", "ttft_ms", "itl_ms", "decode_tokens_per_s", "peak_rss_mb"}
    assert keys <= set(r) and keys - {"model"} <= set(r["baseline"])
    assert set(r["itl_ms"]) == {"p50", "p90", "p99"}
    assert r["new_tokens"] == 8 and r["runs"] == 2 and r["baseline"]["runs"] == 2
    assert r["speedup_vs_baseline"] == pytest.approx(r["decode_tokens_per_s"] / r["baseline"]["decode_tokens_per_s"])
    assert r["baseline"]["dtype"] == "fp32" and r["machine"]["memory_bandwidth_gbs"] > 0
    assert r["config"]["prompt_tokens"] == 32
    assert "decode speedup" in run.stdout


@pytest.mark.parametrize("args, message", [
    (["generate", "model=no-such-model"], "no-such-model"),
    (["generate", "model=/no/such/dir"], "/no/such/dir"),
    (["bench", "prompts=no-such-set"], "no-such-set"),
    (["data", "show", "no-such-dataset"], "no-such-dataset"),
    (["data", "show", "/no/such/file.txt"], "/no/such/file.txt"),
    (["generate", "new_tokens=0"], "new_tokens"),
    (["generate", "prompt="], "empty"),
    (["generate", "hello"], "unexpected argument"),
    (["generate", "kv=int4", "kv.window=64"], "whole key groups"),
    (["serve", "kv.window=2048"], "paged cache"),
])
def test_bad_input_is_one_clear_error(args, message, tiny_llama_dir):
    if args[0] in ("generate", "bench") and not any(a.startswith("model=") for a in args):
        args.append(f"model={tiny_llama_dir}")
    run = specquant(*args)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert message in run.stderr and "fix:" in run.stderr
    assert "Traceback" not in run.stderr


def test_unknown_command_suggests_one():
    run = specquant("genrate")
    assert run.returncode == 2 and "generate" in run.stderr


def test_models_list_and_data_list(tmp_path):
    env = {"SPECQUANT_HOME": str(tmp_path)}
    models = specquant("models", "list", env=env)
    assert models.returncode == 0, models.stderr
    for name in ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        assert name in models.stdout
    data = specquant("data", "list", env=env)
    assert data.returncode == 0, data.stderr
    for name in ("pydoc", "austen", "pydocs", "stdlib-code"):
        assert name in data.stdout
