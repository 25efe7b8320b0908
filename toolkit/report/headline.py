"""The README's headline table: a few rows of the report, written between two markers in README.md by
`specquant report`, so the figures a user sees first are generated from the results store, never typed.

Which rows: every weight configuration with the float KV cache and no speculation (what quantization costs and
buys), the float model with each speculative draft, and transformers' `generate()` beside them. The full table,
with every protocol, is BENCHMARKS.md."""

import re
from pathlib import Path

from toolkit.report.rows import Row

START = "<!-- headline:start -->"
END = "<!-- headline:end -->"

COLUMNS = ["configuration", "Δppl", "KL", "top-1", "decode tok/s", "TTFT ms", "x transformers", "x no-spec"]


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def headline_rows(rows: list[Row]) -> list[Row]:
    floats = {r.model for r in rows if not r.peer and "/" not in r.model}  # registry names, not checkpoint dirs
    out = [r for r in rows if not r.peer and r.kv == "fp" and r.spec == "none" and r.quality and r.speed]
    out += [r for r in rows if not r.peer and r.kv == "fp" and r.spec != "none" and r.model in floats and r.speed]
    out += [r for r in rows if r.peer and r.spec == "generate"]
    return out


def _cells(row: Row) -> list[str]:
    q, s = row.quality, row.speed
    increase = row.ppl_increase
    return [row.label,
            "—" if increase is None else f"{100 * increase:+.2f}%",
            _fmt(q.get("kl"), ".4f"), _fmt(q.get("top1_agreement"), ".3f"),
            _fmt(s.get("decode_tokens_per_s"), ".1f"), _fmt(s.get("ttft_ms"), ".0f"),
            _fmt(s.get("speedup_vs_baseline"), ".2f"), _fmt(s.get("speedup_vs_nospec"), ".2f")]


def render_headline(rows: list[Row], data: str | None) -> str:
    """The block's Markdown (without the markers)."""
    picked = headline_rows(rows)
    cpus = sorted({(r.speed.get("machine") or {}).get("cpu") for r in picked if r.speed} - {None})
    threads = sorted({str(r.speed.get("threads")) for r in picked if r.speed.get("threads")})
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in _cells(r)) + " |" for r in picked]
    note = (f"Quality on {data or 'any dataset'} (evaluation split) against the float model in fp32; speed: "
            f"decode and TTFT on {', '.join(cpus) or 'the recorded CPU'} with {', '.join(threads) or '?'} "
            "threads, greedy, each row interleaved with its baseline in one run. x no-spec: the same engine "
            "without speculation over with it. Written by `specquant report` from the results store; every "
            "row, column and protocol is in [BENCHMARKS.md](BENCHMARKS.md).")
    lines += ["", note]
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
