"""Ratios against a peer per repeat and their median (toolkit/bench/repeats.py), and the bench results that carry
them (`vs_llamacpp`), checked with a fake llama.cpp whose clock is fixed."""

import statistics

import pytest

from toolkit.bench import llamacpp
from toolkit.bench.repeats import Run, repeat_ratios
from tests.test_llamacpp_baseline import _bench, _FakeLlamaCpp


def test_each_repeat_gives_one_ratio_and_the_median_is_quoted():
    ours = [Run(0, 0.1, 10, 1.0), Run(0, 0.3, 10, 1.0), Run(1, 0.2, 20, 1.0), Run(2, 0.2, 5, 1.0)]
    theirs = [Run(0, 0.4, 10, 2.0), Run(1, 0.2, 10, 1.0), Run(2, 0.1, 10, 1.0)]
    got = repeat_ratios(ours, theirs)
    # repeat 0: 20 tokens / 2 s over 10 / 2 s; TTFT 0.4 over the mean of 0.1 and 0.3
    assert got["decode_runs"] == pytest.approx([2.0, 2.0, 0.5])
    assert got["ttft_runs"] == pytest.approx([2.0, 1.0, 0.5])
    assert got["repeats"] == 3 and got["decode_median"] == pytest.approx(2.0) and got["ttft_median"] == 1.0


def test_only_repeats_both_paths_ran_count():
    got = repeat_ratios([Run(0, 1, 1, 1), Run(1, 1, 1, 1)], [Run(1, 2, 1, 2)])
    assert got["repeats"] == 1 and got["decode_runs"] == [2.0]
    with pytest.raises(ValueError, match="no repeat"):
        repeat_ratios([Run(0, 1, 1, 1)], [Run(1, 1, 1, 1)])


@pytest.mark.parametrize("spec", ["none", "lookup"])
def test_a_bench_beside_llama_cpp_records_one_ratio_per_repeat(tiny_llama_dir, tmp_path, monkeypatch, spec):
    monkeypatch.setattr(llamacpp, "unavailable", lambda: None)
    monkeypatch.setattr(llamacpp, "peer_for", lambda *args: _FakeLlamaCpp())
    result = _bench(str(tiny_llama_dir), "llamacpp", tmp_path, f"spec={spec}", "repeats=3", "n_prompts=2")
    ratios = result["vs_llamacpp"]
    assert ratios["repeats"] == 3 and len(ratios["decode_runs"]) == len(ratios["ttft_runs"]) == 3
    assert ratios["decode_median"] == statistics.median(ratios["decode_runs"])
    # the fake decodes 2 tokens/s and takes 1 s to its first token, so each ratio is ours over those
    assert min(ratios["decode_runs"]) <= result["decode_tokens_per_s"] / 2.0 <= max(ratios["decode_runs"])
    assert all(r > 0 for r in ratios["ttft_runs"])
