"""The report layer on a small fixture store: rows join eval and bench results, the Markdown table carries a
protocol beside every number, the Pareto front is right, the PNG and the self-contained HTML are produced, and
recommend picks the fastest configuration within the budget."""

import json
import os
import subprocess
import sys
from html.parser import HTMLParser

import pytest

from toolkit.errors import DataError
from toolkit.report.markdown import render_markdown
from toolkit.report.pareto import pareto_front
from toolkit.report.recommend import recommend
from toolkit.report.rows import build_rows, peer_notes
from toolkit.report.store import read_store
from toolkit.results import append_to_store

# (model, kv, ppl, decode tokens/s): ref ppl is 10.0 for all
CONFIGS = [("smollm2-135m", "fp", 10.0, 30.0), ("ckpt/smollm2-135m-gptq-w4g64", "fp", 10.25, 55.0),
           ("ckpt/smollm2-135m-rtn-w4g64", "fp", 10.6, 56.0), ("ckpt/smollm2-135m-rtn-w8", "int8", 10.02, 45.0),
           ("ckpt/smollm2-135m-gptq-w3g64", "fp", 11.5, 50.0)]


def _eval(model, kv, ppl, data="pydoc/evaluation"):
    return {"kind": "eval", "config": {"model": {"name": model}, "kv": {"kind": kv}}, "model": model, "kv": kv,
            "data": data, "ppl": ppl, "ref_ppl": 10.0, "kl": 0.01, "top1_agreement": 0.95, "cloze_accuracy": 0.4,
            "ref_cloze_accuracy": 0.41, "mc_accuracy": 0.5, "ref_mc_accuracy": 0.52, "gen_prefix_match": 0.8,
            "reference": "smollm2-135m fp32", "protocol": {"ppl": {"text": "pydoc/evaluation, 27 x 512-token windows"}}}


def _bench(model, kv, tps):
    return {"kind": "bench", "config": {"model": {"name": model}, "kv": {"kind": kv}, "spec": {"kind": "none"}},
            "model": model, "prompts": "open", "prompt_tokens": 128, "new_tokens": 64, "runs": 6, "threads": 2,
            "dtype": "int4", "decode_tokens_per_s": tps, "ttft_ms": 200.0, "itl_ms": {"p50": 1000 / tps},
            "speedup_vs_baseline": tps / 20, "machine": {"cpu": "AMD EPYC"}}


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "results.jsonl"
    append_to_store(_eval("ckpt/smollm2-135m-gptq-w4g64", "fp", 99.0), str(path))  # superseded by the later one
    for model, kv, ppl, tps in CONFIGS:
        append_to_store(_eval(model, kv, ppl), str(path))
        append_to_store(_bench(model, kv, tps), str(path))
    append_to_store(_eval("smollm2-135m", "fp", 50.0, data="austen/evaluation"), str(path))  # other dataset
    with open(path, "a") as f:
        f.write('{"kind": "eval", "ppl": 1')  # a torn last line
    return path


def test_store_lines_join_into_configuration_rows(store):
    results, skipped = read_store(store)
    assert skipped == 1 and len(results) == 12
    rows = build_rows(results, "pydoc")
    assert [r.model for r in rows] == [c[0] for c in [CONFIGS[1], CONFIGS[0], *CONFIGS[2:]]]
    gptq = next(r for r in rows if "gptq-w4g64" in r.model)
    assert gptq.ppl_increase == pytest.approx(0.025) and gptq.tokens_per_s == 55.0
    assert next(r for r in rows if r.model == "smollm2-135m").quality["ppl"] == 10.0  # austen row filtered out
    with pytest.raises(DataError):
        read_store(store.parent / "missing.jsonl")


def test_markdown_table_has_a_protocol_mark_beside_every_number(store):
    rows = build_rows(read_store(store)[0], "pydoc")
    text = render_markdown(rows, "Benchmarks")
    table = [line for line in text.splitlines() if line.startswith("| ") and "configuration" not in line]
    assert len(table) == len(CONFIGS)
    for line in table:
        _label, precision, *numbers = line.strip("| ").split(" | ")
        assert precision == "int4"  # the bench result's dtype: what the engine computed in
        for cell in numbers:
            assert cell == "—" or "[q1]" in cell or "[s1]" in cell, cell
    assert "- **[q1]** pydoc/evaluation, 27 x 512-token windows" in text and "**[s1]**" in text
    assert "10.250 (10.000) [q1]" in text and "+2.50% [q1]" in text and "55.0 [s1]" in text


def test_pareto_front_on_hand_checked_points():
    #          fast+bad   slow+good   dominated   fastest+worst
    points = [(50, 2.0), (30, 0.0), (40, 3.0), (56, 6.0)]
    assert pareto_front(points) == [1, 0, 3]


def test_recommend_picks_the_fastest_within_budget(store):
    rows = build_rows(read_store(store)[0], "pydoc")
    best, why = recommend(rows, 0.03)
    assert best.model == "ckpt/smollm2-135m-gptq-w4g64"
    assert any("rtn-w4g64" in line and "over budget" in line for line in why)
    assert recommend(rows, 0.001)[0].model == "smollm2-135m"
    assert recommend(rows, 0.2)[0].model == "ckpt/smollm2-135m-rtn-w4g64"
    with pytest.raises(DataError):
        recommend(rows, -0.5)


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.sources, self.rows = [], [], 0

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        attrs = dict(attrs)
        for key in ("src", "href"):
            if key in attrs:
                self.sources.append(attrs[key])
        self.rows += tag == "tr"


def test_report_cli_writes_table_png_and_self_contained_html(store, tmp_path):
    out, png, page = tmp_path / "BENCHMARKS.md", tmp_path / "pareto.png", tmp_path / "report.html"
    run = subprocess.run([sys.executable, "-m", "toolkit", "report", f"store={store}", f"out={out}", f"png={png}",
                          f"html={page}"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr + run.stdout
    assert "| smollm2-135m-gptq-w4g64, kv fp, spec none |" in out.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    assert Image.open(png).size[0] >= 800
    parsed = _Page()
    parsed.feed(page.read_text())
    assert parsed.rows == len(CONFIGS) + 1 and "img" in parsed.tags and "script" not in parsed.tags
    assert parsed.sources and all(s.startswith("data:image/png;base64,") for s in parsed.sources)  # no network
    rec = subprocess.run([sys.executable, "-m", "toolkit", "recommend", "max_ppl_increase=0.03", f"store={store}"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert rec.returncode == 0 and "smollm2-135m-gptq-w4g64" in rec.stdout.splitlines()[0]


def test_concurrent_appends_never_tear_lines(tmp_path):
    path = tmp_path / "results.jsonl"
    code = ("import sys; from toolkit.results import append_to_store\n"
            "for i in range(50): append_to_store({'kind': 'eval', 'i': i, 'pad': 'x' * 5000}, sys.argv[1])")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)]) for _ in range(3)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    lines = path.read_text().splitlines()
    assert len(lines) == 150 and all(json.loads(line)["kind"] == "eval" for line in lines)


def test_a_speculative_row_takes_the_targets_quality_and_says_so(store):
    results = read_store(store)[0]
    spec = _bench("ckpt/smollm2-135m-gptq-w4g64", "fp", 70.0)
    spec["config"]["spec"] = {"kind": "lookup"}
    rows = build_rows([*results, spec], "pydoc")
    row = next(r for r in rows if r.spec == "lookup")
    target = next(r for r in rows if r.model == row.model and r.spec == "none")
    assert row.quality["ppl"] == 10.25 and row.quality_protocol == target.quality_protocol
    assert row.tokens_per_s == 70.0 and recommend(rows, 0.03)[0] is row
    assert "Rows with speculation show the quality of their target" in render_markdown(rows)


def test_the_html_page_renders_in_headless_chromium_without_network(store, tmp_path):
    from toolkit.report.screenshot import find_chromium

    if find_chromium() is None:
        pytest.skip("no headless Chromium: run eval/get_chromium.sh")
    shot = tmp_path / "shot.png"
    run = subprocess.run([sys.executable, "-m", "toolkit", "report", f"store={store}", f"out={tmp_path / 'B.md'}",
                          f"png={tmp_path / 'p.png'}", f"html={tmp_path / 'r.html'}", f"screenshot={shot}"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr + run.stdout
    from PIL import Image

    image = Image.open(shot).convert("L")
    assert image.size == (1200, 1400)
    # a rendered page is not blank: the table and the inlined plot put dark pixels on it
    assert sum(1 for v in image.getdata() if v < 128) > 5000


def test_the_default_store_follows_specquant_store(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECQUANT_STORE", str(tmp_path / "s.jsonl"))
    assert append_to_store({"kind": "bench"}) == tmp_path / "s.jsonl"
    assert append_to_store({"kind": "bench"}, "none") is None
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 1


def _kv_eval(kind, residual, ppl):
    """A quantized-KV eval with ppl only (what the sweep runs), its residual window in the resolved config."""
    return {"kind": "eval", "config": {"model": {"name": "smollm2-135m"}, "kv": {"kind": kind, "residual": residual}},
            "model": "smollm2-135m", "kv": kind, "data": "pydoc/evaluation", "ppl": ppl, "ref_ppl": 10.0, "kl": 0.02,
            "top1_agreement": 0.9, "protocol": {"ppl": {"text": "pydoc/evaluation, 8 x 512, chunked"}}}


def test_quantized_kv_rows_borrow_cloze_mc_gen_only_when_the_residual_window_holds_them():
    fp = _eval("smollm2-135m", "fp", 10.0)
    fp["protocol"].update({"cloze": {"text": "cloze", "max_context": 128}, "mc": {"text": "mc", "max_context": 128},
                           "gen": {"text": "gen", "prompt_tokens": 64, "new_tokens": 32}})
    rows = {(r.model, r.kv): r for r in build_rows([fp, _kv_eval("int8", 128, 10.05), _kv_eval("int4", 32, 10.4)])}
    wide, narrow = rows[("smollm2-135m", "int8")], rows[("smollm2-135m", "int4")]
    assert wide.quality["cloze_accuracy"] == 0.4 and wide.quality["mc_accuracy"] == 0.5
    assert wide.quality["gen_prefix_match"] == 0.8 and wide.quality["ppl"] == 10.05  # its own ppl stays
    assert "cloze (128 tokens), mc (128 tokens), gen (96 tokens) from the kv=fp row" in wide.quality_protocol
    assert "kv.residual=128" in wide.quality_protocol
    # a 32-token residual window: passages reach quantized keys and values, so nothing can be borrowed
    assert not any(k in narrow.quality for k in ("cloze_accuracy", "mc_accuracy", "gen_prefix_match"))
    assert "from the kv=fp row" not in narrow.quality_protocol


def _spec_bench(kv, tps, speedup, identical=True, peer=False):
    result = {**_bench("smollm2-135m", kv, tps), "spec": "lookup", "draft": "lookup (n-grams 1..3)", "k": 8,
              "adaptive": False, "speedup_vs_nospec": speedup, "identical_outputs": identical,
              "acceptance_rate": 0.4, "mean_accepted": 2.5, "itl_ms": {"mean": 1000 / tps}}
    result["config"]["spec"] = {"kind": "lookup"}
    del result["speedup_vs_baseline"]
    if peer:
        result["peer_assisted"] = {"model": "smollm2-135m", "dtype": "fp32", "k": 8, "speedup_vs_generate": 1.2,
                                   "identical_outputs": True, "generate": {"tokens_per_s": 20.0},
                                   "assisted": {"decode_tokens_per_s": 25.0, "ttft_ms": 90.0, "tokens_per_s": 24.0}}
    return result


def test_spec_and_peer_rows_show_speedups_acceptance_and_the_reference_quality():
    plain = {**_bench("smollm2-135m", "fp", 30.0), "baseline": {"decode_tokens_per_s": 20.0, "ttft_ms": 100.0,
                                                               "itl_ms": {"p50": 50.0}, "dtype": "fp32"}}
    results = [_eval("smollm2-135m", "fp", 10.5), plain, _spec_bench("fp", 60.0, 1.9, peer=True),
               _spec_bench("int8", 50.0, 1.6, identical=False)]
    rows = build_rows(results)
    spec = next(r for r in rows if r.spec == "lookup" and r.kv == "fp")
    assert spec.quality["ppl"] == 10.5
    peers = [r for r in rows if r.peer]
    assert [r.spec for r in peers] == ["generate", "assisted"]
    assert all(r.quality["ppl"] == r.quality["ref_ppl"] == 10.0 and r.quality["kl"] == 0.0 for r in peers)
    assert peers[1].speed["speedup_vs_nospec"] == 1.2 and peers[0].tokens_per_s == 20.0
    text = render_markdown(rows)
    line = next(li for li in text.splitlines() if "kv fp, spec lookup" in li)
    assert "| 1.90 [s" in line and "0.40 (2.5/round)" in line and "50.0 mean" not in line and "16.7 mean" in line
    assert "| 1.60 (outputs differ) [s" in next(li for li in text.splitlines() if "kv int8, spec lookup" in li)
    assert "peer: transformers assisted generation (prompt lookup, k=8)" in text
    # a spec=draft bench adds its own peer row beside the prompt-lookup one, not in its place
    drafted = _spec_bench("fp", 40.0, 1.3, peer=True)
    drafted["config"]["spec"] = {"kind": "draft", "model": "smollm2-135m"}
    drafted["spec"] = "draft"
    drafted["peer_assisted"]["draft"] = "smollm2-135m"
    both = [r.label for r in build_rows(results + [drafted]) if r.peer]
    assert len(both) == 3 and any("(draft model smollm2-135m)" in label for label in both)
    assert recommend(rows, 0.1)[0].peer is False  # peers are shown, never recommended
    notes = peer_notes(rows)
    assert len(notes) == 1 and notes[0].startswith("llama.cpp")  # both transformers peers are there
    # without the spec=lookup bench there is no assisted-generation row, and the note says so
    assert [n.split(":")[0] for n in peer_notes(build_rows(results[:2]))] == ["transformers assisted generation",
                                                                              "llama.cpp"]
