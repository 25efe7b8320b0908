"""The README's headline table: a few rows of the report, written between two markers in README.md by
`specquant report`, so the figures a user sees first are generated from the results store, never typed.

Which rows: every weight configuration with the float KV cache and no speculation (what quantization costs and
buys), the float model with each speculative draft, transformers' `generate()` beside them, and where the runs
included llama.cpp, its decode ratio on every row that ran beside it and one llama.cpp row per GGUF type. The full
table, with every protocol, is BENCHMARKS.md."""

import re
from pathlib import Path

from toolkit.report.rows import Row

START = "<!-- headline:start -->"
END = "<!-- headline:end -->"

COLUMNS = ["configuration", "Δppl", "KL", "top-1", "decode tok/s", "TTFT ms", "x transformers", "x no-spec"]
LLAMACPP_COLUMNS = ["x llama.cpp", "TTFT x llama.cpp"]  # only when a picked row ran beside llama.cpp


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def headline_rows(rows: list[Row]) -> list[Row]:
    floats = {r.model for r in rows if not r.peer and "/" not in r.model}  # registry names, not checkpoint dirs
    out = [r for r in rows if not r.peer and r.kv == "fp" and r.spec == "none" and r.quality and r.speed]
    out += [r for r in rows if not r.peer and r.kv == "fp" and r.spec != "none" and r.model in floats and r.speed]
    out += [r for r in rows if r.peer and r.spec == "generate"]
    # llama.cpp: one row per GGUF type (F16, Q8_0, Q4_0), from the first picked row that ran beside it; every
    # picked row that did carries its own ratio in the x llama.cpp columns
    beside = {r.key for r in out}
    kinds = {}
    for r in rows:
        if r.peer and r.kv == "llama.cpp" and r.beside in beside:
            kinds.setdefault(r.spec, r)
    return out + list(kinds.values())


def _cells(row: Row, llamacpp: bool) -> list[str]:
    q, s = row.quality, row.speed
    increase = row.ppl_increase
    cells = [row.label,
             "—" if increase is None else f"{100 * increase:+.2f}%",
             _fmt(q.get("kl"), ".4f"), _fmt(q.get("top1_agreement"), ".3f"),
             _fmt(s.get("decode_tokens_per_s"), ".1f"), _fmt(s.get("ttft_ms"), ".0f"),
             _fmt(s.get("speedup_vs_baseline"), ".2f"), _fmt(s.get("speedup_vs_nospec"), ".2f")]
    if llamacpp:
        cells += [_fmt(s.get("speedup_vs_llamacpp"), ".2f"), _fmt(s.get("ttft_speedup_vs_llamacpp"), ".2f")]
    return cells


def render_headline(rows: list[Row], data: str | None, beside_llamacpp: str = "") -> str:
    """The block's Markdown (without the markers); `beside_llamacpp`: the medians table (toolkit.report.llamacpp),
    placed under the headline rows."""
    picked = headline_rows(rows)
    llamacpp = any(r.peer and r.kv == "llama.cpp" for r in picked)
    columns = COLUMNS + (LLAMACPP_COLUMNS if llamacpp else [])
    cpus = sorted({(r.speed.get("machine") or {}).get("cpu") for r in picked if r.speed} - {None})
    threads = sorted({str(r.speed.get("threads")) for r in picked if r.speed.get("threads")})
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(["---"] + ["---:"] * (len(columns) - 1)) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in _cells(r, llamacpp)) + " |" for r in picked]
    note = (f"Quality on {data or 'any dataset'} (evaluation split) against the float model in fp32; speed: "
            f"decode and TTFT on {', '.join(cpus) or 'the recorded CPU'} with {', '.join(threads) or '?'} "
            "threads, greedy, each row interleaved with its baseline in one run. x no-spec: the same engine "
            "without speculation over with it.")
    if llamacpp:
        note += (" x llama.cpp: decode tokens/s over llama.cpp's in the same run (llama-cpp-python on the engine's "
                 "weights exported as GGUF where the row says \"same weights\", else the model's GGUF requantized to "
                 "the nearest type); TTFT x llama.cpp: its TTFT over the engine's; one llama.cpp row per type.")
    note += (" Written by `specquant report` from the results store; every row, column and protocol is in "
             "[BENCHMARKS.md](BENCHMARKS.md).")
    lines += ["", note]
    if beside_llamacpp:
        lines += ["", "Beside llama.cpp, medians of repeats:", "", beside_llamacpp]
    return "\n".join(lines)


def update_readme(path: str | Path, block: str) -> bool:
    """Replace what sits between the markers; False (file untouched) when the file or a marker is missing."""
    path = Path(path)
    if not path.is_file():
        return False
    text = path.read_text()
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        return False
    new = pattern.sub(lambda _: f"{START}\n{block}\n{END}", text, count=1)
    if new != text:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(new)
        tmp.replace(path)
    return True
