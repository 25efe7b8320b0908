"""llama.cpp beside the engine in the report: a bench line that ran `baseline=llamacpp` gives its row x llama.cpp and
TTFT x llama.cpp, and a llama.cpp row of its own right below it, every number with a protocol mark; without such a
line the report says why; engine.native_dot=int8 (int4 weights x int8 activations) is a configuration of its own,
never merged with the exact one. All on synthetic store lines shaped as `specquant bench` / `eval` write them."""

import pytest
from omegaconf import OmegaConf

from toolkit.report.headline import render_headline
from toolkit.report.markdown import COLUMNS, render_markdown
from toolkit.report.pareto import _weights_label
from toolkit.report.recommend import recommend
from toolkit.report.rows import build_rows, engine_variant, peer_notes

CKPT = "ckpt/smollm2-135m-rtn-w4g64"
EXACT = "rtn int4 g64 + fp16 w / fp32 a"
W4A8 = "rtn int4 g64 + fp16 w / fp32 a, int8 activations (w4a8)"


def _engine(native_dot=None):
    engine = {"device": "cpu", "dtype": "auto", "weight_dtype": "auto", "prefill_dtype": "fp32", "forward": "auto"}
    if native_dot is not None:  # None: a line written before the setting existed
        engine["native_dot"] = native_dot
    return engine


def _eval(model, ppl, native_dot=None, dtype="fp16 w / fp32 a"):
    return {"kind": "eval", "config": {"model": {"name": model}, "kv": {"kind": "fp"}, "engine": _engine(native_dot)},
            "model": model, "kv": "fp", "data": "pydoc/evaluation", "ppl": ppl, "ref_ppl": 10.0, "kl": 0.1,
            "top1_agreement": 0.8, "dtype": dtype,
            "protocol": {"ppl": {"text": f"pydoc/evaluation, 8 x 512-token windows ({native_dot or 'fp32'} dot)"}}}


def _llamacpp(gguf, tps, ttft):
    return {"name": "llama.cpp", "dtype": f"llama.cpp {gguf}", "prompt_tokens": 127, "new_tokens": 64, "runs": 2,
            "ttft_ms": ttft, "itl_ms": {"p50": 1000 / tps, "p90": 1100 / tps, "p99": 1200 / tps},
            "decode_tokens_per_s": tps, "peak_rss_mb": 900.0,
            "decode_floor": {"weight_bytes": 90_000_000, "floor_tokens_per_s": 300.0, "times_floor": 300.0 / tps}}


def _bench(model, dtype, tps, ttft, native_dot=None, llamacpp=None, unavailable=None):
    result = {"kind": "bench", "config": {"model": {"name": model}, "kv": {"kind": "fp"}, "spec": {"kind": "none"},
                                          "engine": _engine(native_dot), "baseline": "hf,llamacpp"},
              "model": model, "prompts": "open", "prompt_tokens": 127, "new_tokens": 64, "runs": 2, "threads": 2,
              "dtype": dtype, "decode_tokens_per_s": tps, "ttft_ms": ttft, "itl_ms": {"p50": 1000 / tps},
              "machine": {"cpu": "AMD EPYC"}}
    if llamacpp is not None:
        peer = _llamacpp(*llamacpp)
        result.update(llamacpp=peer, speedup_vs_llamacpp=tps / peer["decode_tokens_per_s"],
                      ttft_speedup_vs_llamacpp=peer["ttft_ms"] / ttft, greedy_token_agreement_vs_llamacpp=0.625)
    if unavailable is not None:
        result["llamacpp"] = {"unavailable": unavailable}
    return result


def _store():
    """A float model and an int4 checkpoint (exact, and engine.native_dot=int8), each benched beside llama.cpp."""
    return [_eval("smollm2-135m", 10.0),
            _bench("smollm2-135m", "fp16 w / fp32 a", 95.0, 150.0, llamacpp=("F16", 90.0, 200.0)),
            _eval(CKPT, 11.0), _bench(CKPT, EXACT, 130.0, 210.0, llamacpp=("Q4_0", 160.0, 140.0)),
            _eval(CKPT, 11.2, native_dot="int8"),
            _bench(CKPT, W4A8, 170.0, 120.0, native_dot="int8", llamacpp=("Q4_0", 155.0, 150.0))]


def _table(text):
    return {line.strip("| ").split(" | ")[0]: line.strip("| ").split(" | ")
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| configuration")}


def test_llamacpp_rows_and_columns_appear_beside_the_run_they_were_interleaved_with():
    rows = build_rows(_store(), "pydoc")
    labels = [r.label for r in rows]
    assert labels == [
        "smollm2-135m, kv fp, spec none",
        ("llama.cpp F16 (same prompts, interleaved with smollm2-135m, kv fp, spec none; greedy token agreement "
         "0.625)"),
        "smollm2-135m-rtn-w4g64, kv fp, spec none",
        ("llama.cpp Q4_0 (same prompts, interleaved with smollm2-135m-rtn-w4g64, kv fp, spec none; greedy token "
         "agreement 0.625)"),
        "smollm2-135m-rtn-w4g64, kv fp, spec none, engine.native_dot=int8",
        ("llama.cpp Q4_0 (same prompts, interleaved with smollm2-135m-rtn-w4g64, kv fp, spec none, "
         "engine.native_dot=int8; greedy token agreement 0.625)")]
    text = render_markdown(rows)
    assert "x llama.cpp" in COLUMNS and "TTFT x llama.cpp" in COLUMNS
    table, column = _table(text), {name: i for i, name in enumerate(COLUMNS)}
    engine = table["smollm2-135m-rtn-w4g64, kv fp, spec none"]
    peer = table[labels[3]]
    assert engine[column["x llama.cpp"]].startswith("0.81 [s")
    assert engine[column["TTFT x llama.cpp"]].startswith("0.67 [s")
    assert peer[column["precision"]] == "GGUF Q4_0 (llama.cpp)"
    assert peer[column["decode tok/s"]].startswith("160.0 [s") and peer[column["TTFT ms"]].startswith("140.0 [s")
    assert peer[column["ITL ms"]].startswith("6.2 [s")
    assert all(peer[column[c]] == "—" for c in ("ppl (ref)", "Δppl", "KL", "x llama.cpp", "x transformers"))
    # every number, the llama.cpp rows' included, carries a mark, and every mark is listed with its protocol
    marks = set()
    for cells in table.values():
        for cell in cells[2:]:
            assert cell == "—" or "[q" in cell or "[s" in cell, cell
            marks.update(part.split("]")[0] for part in cell.split("[")[1:])
    protocols = text.split("## Protocols", 1)[1]
    assert marks and all(f"**[{mark}]**" in protocols for mark in marks)
    assert "llama.cpp (llama-cpp-python) on the model's GGUF requantized by llama.cpp to Q4_0" in protocols
    assert "interleaved with llama.cpp Q4_0 on the same prompt token ids" in protocols
    assert "x llama.cpp: decode tokens/s over llama.cpp's" in text
    assert not any(n.startswith("llama.cpp") for n in peer_notes(rows))  # shown, so not noted as missing
    # shown beside ours, never recommended (its weights are not ours, and it has no quality figures)
    assert all(r.peer for r in rows if r.kv == "llama.cpp") and not recommend(rows, 1.0)[0].peer


def test_the_note_says_why_when_no_line_ran_llamacpp(monkeypatch):
    from toolkit.report import rows as rows_module

    plain = [_eval(CKPT, 11.0), _bench(CKPT, EXACT, 130.0, 210.0)]
    rows = build_rows(plain)
    assert not any(r.kv == "llama.cpp" for r in rows)
    row = _table(render_markdown(rows))["smollm2-135m-rtn-w4g64, kv fp, spec none"]
    assert row[COLUMNS.index("x llama.cpp")] == row[COLUMNS.index("TTFT x llama.cpp")] == "—"
    monkeypatch.setattr(rows_module.importlib.util, "find_spec", lambda name: None)
    assert any(n.startswith("llama.cpp: llama-cpp-python is not installed here") for n in peer_notes(rows))
    monkeypatch.setattr(rows_module.importlib.util, "find_spec", lambda name: object())
    assert any(n.startswith("llama.cpp: no bench result in the store ran it") for n in peer_notes(rows))
    # a run that asked for llama.cpp and could not run it: its reason
    asked = build_rows([_bench(CKPT, EXACT, 130.0, 210.0, unavailable="llama-cpp-python is not installed")])
    assert any("could not run it (llama-cpp-python is not installed)" in n for n in peer_notes(asked))


def test_the_report_note_lists_missing_peers_only(tmp_path):
    import json

    from toolkit.cli import report

    def note(results):
        store = tmp_path / "s.jsonl"
        store.write_text("".join(json.dumps(r) + "\n" for r in results))
        cfg = OmegaConf.create({"store": str(store), "data": "pydoc", "out": str(tmp_path / "B.md"), "png": None,
                                "html": None, "title": "t"})
        report.run(cfg)
        return (tmp_path / "B.md").read_text().split("\n\n")[1]

    alone = note([_bench(CKPT, EXACT, 130.0, 210.0)])
    assert "Peers not shown:" in alone and "llama.cpp:" in alone
    assert "llama.cpp:" not in note(_store())  # the transformers peers are still noted missing
    assert "Peers not shown: transformers generate()" in note(_store())


def test_int8_activation_rows_are_distinct_from_the_exact_ones():
    old = _bench(CKPT, EXACT, 120.0, 200.0)  # written before engine.native_dot existed: the exact configuration
    del old["config"]["engine"]
    results = [old, *_store()]
    assert engine_variant(results[0]) == engine_variant(results[4]) == ""
    assert engine_variant(results[-1]) == "engine.native_dot=int8"
    assert engine_variant({"config": {"engine": {"native_dot": "int8", "dtype": "bf16"}}}) == (
        "engine.native_dot=int8 engine.dtype=bf16")
    rows = [r for r in build_rows(results, "pydoc") if r.model == CKPT and not r.peer]
    exact, w4a8 = rows
    assert (exact.variant, w4a8.variant) == ("", "engine.native_dot=int8")
    assert exact.quality["ppl"] == 11.0 and w4a8.quality["ppl"] == 11.2  # each joined to its own eval
    assert exact.tokens_per_s == 130.0 and w4a8.tokens_per_s == 170.0  # the later exact bench replaced the old one
    assert exact.precision == EXACT and w4a8.precision == W4A8
    assert _weights_label(exact) != _weights_label(w4a8)  # their own colour in the Pareto plot
    table = _table(render_markdown(build_rows(results, "pydoc")))
    assert table["smollm2-135m-rtn-w4g64, kv fp, spec none, engine.native_dot=int8"][1] == W4A8
    assert table["smollm2-135m-rtn-w4g64, kv fp, spec none"][1] == EXACT
    assert recommend(build_rows(results, "pydoc"), 0.5)[0] is not None


def test_headline_gains_the_llamacpp_columns_and_one_row_per_type_only_where_present():
    block = render_headline(build_rows(_store(), "pydoc"), "pydoc")
    lines = block.splitlines()
    assert lines[0].endswith("| x llama.cpp | TTFT x llama.cpp |")
    body = [line for line in lines[2:] if line.startswith("| ")]
    assert [line.split(" | ")[0] for line in body] == [
        "| smollm2-135m, kv fp, spec none", "| smollm2-135m-rtn-w4g64, kv fp, spec none",
        "| smollm2-135m-rtn-w4g64, kv fp, spec none, engine.native_dot=int8",
        ("| llama.cpp F16 (same prompts, interleaved with smollm2-135m, kv fp, spec none; greedy token agreement "
         "0.625)"),
        ("| llama.cpp Q4_0 (same prompts, interleaved with smollm2-135m-rtn-w4g64, kv fp, spec none; greedy token "
         "agreement 0.625)")]
    int8 = next(line for line in body if "native_dot=int8" in line and not line.startswith("| llama.cpp"))
    assert int8.endswith("| 1.10 | 1.25 |")
    assert "x llama.cpp: decode tokens/s over llama.cpp's in the same run" in block
    without = render_headline(build_rows([_eval(CKPT, 11.0), _bench(CKPT, EXACT, 130.0, 210.0)], "pydoc"), "pydoc")
    assert "llama.cpp" not in without and without.splitlines()[0].endswith("| x no-spec |")


@pytest.mark.parametrize("dtype", ["llama.cpp Q8_0", "Q8_0"])
def test_the_gguf_type_is_read_from_the_peer_figures(dtype):
    from toolkit.report.rows import gguf_type

    assert gguf_type({"dtype": dtype}) == "Q8_0"
    assert gguf_type({"dtype": "llama.cpp Q4_0", "gguf_type": "Q4_K"}) == "Q4_K"
