"""`python -m benchmarks.paged` end to end on a tiny model with tiny sizes: the JSON it writes is self-consistent
(counts, ratios, identical outputs) and lands in the results store. Never asserts speed."""

import json

import pytest

from benchmarks import paged
from toolkit.errors import InputError

# fp32: paged and contiguous attention give identical tokens in fp32 (in bf16, on a CPU where the engine defaults
# to it, their sums round differently and near-ties flip)
TINY = ["--dtype", "fp32", "--threads", "1", "--budget-mb", "0.25", "--block-size", "8", "--prompt-min", "16", "--prompt-max", "64",
        "--output-min", "4", "--max-tokens", "32", "--max-seq-len", "128", "--system-tokens", "64", "--turns", "2",
        "--turn-tokens", "8", "--prefix-new-tokens", "4", "--itl-batch", "3", "--itl-prompt-min", "16",
        "--itl-prompt-max", "40", "--itl-new-tokens", "6", "--itl-runs", "2"]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def ran(request, tmp_path_factory, tiny_llama_dir, tiny_gemma3_dir):
    model = tiny_llama_dir if request.param == "llama" else tiny_gemma3_dir
    tmp = tmp_path_factory.mktemp("paged-bench")
    out, store = tmp / "paged.json", tmp / "results.jsonl"
    returned = paged.main(["--model", str(model), *TINY, "--out", str(out), "--store", str(store)])
    return returned, json.loads(out.read_text()), [json.loads(line) for line in store.read_text().splitlines()], store


def test_result_written_and_stored(ran):
    from toolkit.report.rows import build_rows
    from toolkit.report.store import read_store

    returned, written, stored, store = ran
    assert written["kind"] == "bench" and written["kv"] == "paged" and written["config"]["bench"] == "paged"
    assert len(stored) == 1 and stored[0]["capacity"] == written["capacity"] == returned["capacity"]
    # `specquant report` reads the store without error and makes no speed row of it (not the plain model's)
    results, bad = read_store(store)
    assert bad == 0 and len(results) == 1 and build_rows(results) == []
    assert written["dtype"] == "fp32"  # as asked
    assert set(written["acceptance"]) == {"capacity_3x", "prefix_ttft_5x", "itl_within_10pct"}


def test_capacity_is_the_allocators_count(ran):
    cap = ran[1]["capacity"]
    per_block = cap["bytes_per_token"] * cap["block_size"]
    for stage in ("mid_flight", "at_completion"):
        got = cap["paged"][stage]
        assert got["sequences"] >= 1
        assert got["bytes_used"] == got["blocks_used"] * per_block <= got["pool_bytes"] <= cap["budget_bytes"]
        # every held token has a slot, and no sequence holds more than one partly filled block
        assert got["tokens_held"] <= got["blocks_used"] * cap["block_size"]
        assert got["blocks_used"] < got["tokens_held"] / cap["block_size"] + got["sequences"] + 1
    # mid flight every sequence holds at most what it holds at completion: at least as many fit
    assert cap["paged"]["mid_flight"]["sequences"] >= cap["paged"]["at_completion"]["sequences"]
    pre = cap["preallocated"]
    assert pre["prompt_plus_max_tokens"] >= pre["left_padded_batch"]
    budget_tokens = cap["budget_bytes"] / cap["bytes_per_token"]
    assert pre["max_seq_len"] == int(budget_tokens // cap["protocol"]["max_seq_len"])
    assert cap["ratio"] == cap["paged"]["mid_flight"]["sequences"] / pre["prompt_plus_max_tokens"]
    assert 0 < cap["preallocated_utilisation_mid_flight"] <= 1


def test_prefix_reuse_is_exact_and_hits(ran):
    pre = ran[1]["prefix"]
    assert pre["identical_outputs"] and pre["identical_to_engine"]
    assert len(pre["ttft_ms"]["reuse"]) == len(pre["ttft_ms"]["no_reuse"]) == pre["protocol"]["turns"]
    assert pre["speedup"] == pytest.approx(pre["ttft_ms_p50"]["no_reuse"] / pre["ttft_ms_p50"]["reuse"])
    # each turn found at least the whole blocks of the system prompt (more only where turns share a start: the
    # "User:" template), never its whole prompt
    system, block = pre["protocol"]["system_tokens"], pre["protocol"]["block_size"]
    assert system == 64
    for cached, turn in zip(pre["cached_tokens"], pre["protocol"]["turn_tokens"]):
        assert system // block * block <= cached < system + turn and cached % block == 0
    assert pre["evictions"] == 0


def test_itl_paged_matches_contiguous(ran):
    itl = ran[1]["itl"]
    assert itl["identical_outputs"] and itl["identical_rows"] == "3/3"
    assert itl["ratio"] == pytest.approx(itl["itl_ms_p50"]["paged"] / itl["itl_ms_p50"]["contiguous"])
    assert all(len(v) == itl["protocol"]["runs"] for v in itl["itl_ms_p50_per_run"].values())


def test_bad_flags_are_clear_errors():
    with pytest.raises(InputError, match="--prompt-min"):
        paged.parse_args(["--prompt-min", "100", "--prompt-max", "50"])
    with pytest.raises(InputError, match="--turns"):
        paged.parse_args(["--turns", "0"])
