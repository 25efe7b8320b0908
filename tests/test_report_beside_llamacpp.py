"""The "Beside llama.cpp" table (toolkit/report/llamacpp.py): bench lines with three or more repeats beside
llama.cpp, one row per configuration and prompt length with the median and range of the per-repeat ratios; kept
apart from the main table's rows when tagged as a dedicated benchmark (`+bench=llamacpp`, as eval/sweep.sh's
llama.cpp phase writes them). Synthetic store lines shaped as `specquant bench` writes them."""

from toolkit.report.headline import render_headline
from toolkit.report.llamacpp import render_side_by_side, side_by_side
from toolkit.report.markdown import render_markdown
from toolkit.report.rows import build_rows
from tests.test_report_llamacpp import CKPT, EXACT, _bench, _eval


def _medians(result, decode_runs, ttft_runs, prompt_tokens=127, spec=None, tag=True):
    result = dict(result, prompt_tokens=prompt_tokens)
    result["config"] = dict(result["config"], **({"bench": "llamacpp"} if tag else {}))
    if spec:
        result["config"]["spec"] = {"kind": spec}
        result["identical_runs"] = "3/3"
    result["vs_llamacpp"] = {"repeats": len(decode_runs), "decode_runs": decode_runs, "ttft_runs": ttft_runs,
                             "decode_median": sorted(decode_runs)[len(decode_runs) // 2],
                             "ttft_median": sorted(ttft_runs)[len(ttft_runs) // 2]}
    result["machine"] = {"cpu": "AMD EPYC", "cpu_flags": ["avx2", "avx512f"]}
    return result


def _ckpt(tps=130.0):
    return _bench(CKPT, EXACT, tps, 210.0, llamacpp=("Q4_0", 160.0, 140.0))


def test_one_row_per_configuration_and_prompt_length_latest_wins_fewer_than_three_repeats_left_out():
    store = [_medians(_ckpt(), [1.0, 1.2, 1.1], [2.0, 2.1, 1.9]),
             _medians(_ckpt(), [1.3, 1.2, 1.1], [2.0, 2.1, 1.9]),  # the same again, later: it wins
             _medians(_ckpt(), [1.4, 1.5, 1.6], [1.8, 1.7, 1.9], prompt_tokens=512),
             _medians(_ckpt(), [0.9, 1.0], [1.0, 1.0], prompt_tokens=1024),  # 2 repeats: no median shown
             _medians(_ckpt(), [2.9, 3.0, 3.1], [1.0, 1.1, 1.2], spec="lookup")]
    shown = side_by_side(store)
    assert [(r["prompt_tokens"], r["config"]["spec"]["kind"]) for r in shown] == [(127, "none"), (512, "none"),
                                                                                    (127, "lookup")]
    text = render_side_by_side(store)
    rows = [line for line in text.splitlines() if line.startswith("| smollm2")]
    assert rows[0].split(" | ")[1:] == ["Q4_0", "native_dot=fp32 (exact)", "none", "open", "127",
                                        "**1.20** (1.10-1.30)", "**2.00** (1.90-2.10)", "—", "3 |"]
    assert "**3.00** (2.90-3.10)" in rows[2] and "3/3" in rows[2]
    assert "avx2 avx512f" in text


def test_the_table_joins_the_report_and_the_headline_and_tagged_lines_stay_out_of_the_main_rows():
    store = [_eval(CKPT, 11.0), _ckpt(), _medians(_ckpt(tps=999.0), [1.0, 1.2, 1.1], [2.0, 2.1, 1.9],
                                                   prompt_tokens=512)]
    rows = build_rows(store, "pydoc")
    assert [r.speed["decode_tokens_per_s"] for r in rows if not r.peer] == [130.0]  # the tagged 512 line is apart
    beside = render_side_by_side(store)
    assert "## Beside llama.cpp" in render_markdown(rows, "B", "", beside)
    assert beside in render_headline(rows, "pydoc", beside)
    assert render_side_by_side([_eval(CKPT, 11.0), _ckpt()]) == ""
    assert "## Beside llama.cpp" not in render_markdown(rows, "B", "", "")
