"""llama.cpp as a bench baseline (toolkit/bench/llamacpp.py): the type nearest the engine's weights, a clear
"unavailable" in the result where llama-cpp-python is not built, and -- where it is, with the real SmolLM2 --
a row measured on the same prompts beside the engine's."""

import pytest
from hydra import compose, initialize_config_dir

from toolkit.bench import llamacpp
from toolkit.cli.app import CONF_DIR


def test_the_type_follows_the_engines_weight_bits():
    assert [llamacpp.nearest_type(b) for b in (None, 8, 4, 3)] == ["F16", "Q8_0", "Q4_0", "Q4_0"]


def _bench(model: str, baseline: str, tmp_path, *more: str):
    from toolkit.cli.bench import run

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("bench", overrides=[f"model.name={model}", f"baseline={baseline}", "prompts=open",
                                          "prompt_tokens=24", "new_tokens=4", "n_prompts=1", "repeats=1",
                                          "warmup=0", f"out={tmp_path / 'b.json'}", "+store=none", *more])
    return run(cfg)


class _FakeLlamaCpp:
    """What `llamacpp.peer_for` returns, without llama-cpp-python: fixed tokens, a made-up clock (1 s to the first
    token, then 0.5 s a token), so the spec bench's llama.cpp figures can be checked exactly."""
    path, weights, fallback_reason, kv_type = "fake.gguf", "same weights", None, "f16"

    def weight_bytes(self):
        return 1 << 20

    def kv_bytes_per_element(self):
        return llamacpp.KV_TYPE_BYTES[self.kv_type]

    def run(self, ids, new_tokens):
        from toolkit.timing import GenerationTiming

        return list(range(new_tokens)), GenerationTiming(len(ids), 1, ttft_s=1.0, itl_s=[0.5] * (new_tokens - 1))

    def describe(self):
        return "llama.cpp F16, same weights"


def test_llama_cpp_keeps_its_kv_cache_at_the_engines_kv_bits(tiny_llama_dir, tmp_path, monkeypatch):
    """kv=int8 / int4 runs llama.cpp with a q8_0 / q4_0 KV cache (its `type_k` / `type_v`): the result and the
    "Beside llama.cpp" table say which, and its floor counts those bytes."""
    from toolkit.report.llamacpp import _cells

    assert [llamacpp.kv_type(k) for k in ("fp", "int8", "int4", "int2")] == ["f16", "q8_0", "q4_0", "q4_0"]
    asked = []

    def peer_for(model, bits, n_ctx, threads, kv="f16"):
        asked.append(kv)
        peer = _FakeLlamaCpp()
        peer.kv_type = kv
        return peer

    monkeypatch.setattr(llamacpp, "unavailable", lambda: None)
    monkeypatch.setattr(llamacpp, "peer_for", peer_for)
    floors = {}
    for kv in ("fp", "int8", "int4"):
        result = _bench(str(tiny_llama_dir), "llamacpp", tmp_path, f"kv={kv}", "repeats=3")
        assert result["llamacpp"]["kv_type"] == llamacpp.kv_type(kv)
        # bytes a step (the bandwidth is measured per run)
        floors[kv] = result["machine"]["memory_bandwidth_gbs"] * 1e9 / result["llamacpp"]["decode_floor"][
            "floor_tokens_per_s"] - (1 << 20)
        theirs = _cells(result)[1]
        assert theirs == ("F16" if kv == "fp" else f"F16, KV {llamacpp.kv_type(kv)}"), theirs
    assert asked == ["f16", "q8_0", "q4_0"]
    assert floors["fp"] / 2 == pytest.approx(floors["int8"] / (34 / 32)) == pytest.approx(floors["int4"] / (18 / 32))


def test_the_spec_bench_times_llama_cpp_plain_decode_beside_speculation(tiny_llama_dir, tmp_path, monkeypatch):
    """spec=lookup baseline=llamacpp: llama.cpp without speculation runs on the same prompts, interleaved, and the
    result carries our speculative decode over its plain decode."""
    monkeypatch.setattr(llamacpp, "unavailable", lambda: None)
    monkeypatch.setattr(llamacpp, "peer_for", lambda *args: _FakeLlamaCpp())
    result = _bench(str(tiny_llama_dir), "llamacpp", tmp_path, "spec=lookup")
    theirs = result["llamacpp"]
    assert theirs["dtype"] == "llama.cpp F16, same weights" and theirs["ttft_ms"] == 1000
    assert theirs["decode_tokens_per_s"] == 2.0  # 3 tokens after the first in 1.5 s
    assert result["speedup_vs_llamacpp"] == result["decode_tokens_per_s"] / 2.0
    assert result["identical_outputs"] is True and 0 <= result["greedy_token_agreement_vs_llamacpp"] <= 1
    monkeypatch.setattr(llamacpp, "unavailable", lambda: "llama-cpp-python is not installed (test)")
    result = _bench(str(tiny_llama_dir), "llamacpp", tmp_path, "spec=lookup")
    assert result["llamacpp"] == {"unavailable": "llama-cpp-python is not installed (test)"}


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


@pytest.mark.real_model
def test_llama_cpp_runs_beside_speculation_on_the_same_prompts(smollm2, tmp_path):
    if llamacpp.unavailable():
        pytest.skip(llamacpp.unavailable())
    result = _bench("smollm2-135m", "llamacpp", tmp_path, "spec=lookup", "prompts=grounded", "prompt_tokens=96")
    assert result["llamacpp"]["weights"] == "same weights" and result["llamacpp"]["decode_tokens_per_s"] > 0
    assert result["identical_outputs"] is True and result["speedup_vs_llamacpp"] > 0


def test_every_llama_cpp_run_prefills_its_whole_prompt():
    """llama-cpp-python reuses the longest prefix its context holds; a bench run must not (the engine prefills
    every prompt in full), so the context is reset before each run."""
    calls = []

    class FakeLlama:
        def reset(self):
            calls.append("reset")

        def generate(self, ids, **kwargs):
            calls.append(("generate", len(ids)))
            yield from range(100, 110)

    peer = llamacpp.LlamaCpp.__new__(llamacpp.LlamaCpp)
    peer.llm = FakeLlama()
    for _ in range(2):
        tokens, timing = peer.run(list(range(20)), 4)
        assert tokens == [100, 101, 102, 103] and timing.new_tokens == 4
    assert calls == ["reset", ("generate", 20)] * 2
