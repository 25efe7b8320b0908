"""The report on the terminal (rich tables, one per section) and the PNG of the TTFT / decode split per option."""

from rich.console import Console
from rich.table import Table

from toolkit.engine.kernel_paths import summary


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def prefix_line(report: dict) -> str:
    """Section 1's word on the repeated prefix: what the prefix-cache what-if measured on it, when it ran."""
    w = report["workload"]
    repeated = (f"{w['repeated_prefix_share']:.1%} of prompt tokens ({w['repeated_prefix_tokens']} of {w['tokens']}) "
                "repeat an earlier prompt's start")
    measured = report["whatifs"].get("prefix_cache")
    if measured is None:
        return f"prefix cache: {repeated}; not measured (see the notes under section 5)" if \
            w["repeated_prefix_tokens"] else "prefix cache: no prompt begins like an earlier one, nothing to reuse"
    rows = report["whatifs"]["rows"]
    return (f"prefix cache: {repeated}; the prefix-cache what-if found {measured['cached_tokens']} of them cached "
            f"(whole {measured['block_size']}-token blocks): median TTFT {rows['baseline']['ttft_ms']:.1f} -> "
            f"{rows['prefix-cache']['ttft_ms']:.1f} ms (section 5)")


def print_report(report: dict, console: Console) -> None:
    w = report["workload"]
    t = Table(title="1. Input", title_justify="left")
    for col in ("prompts", "chars", "tokens", "tokens/prompt", "tokens/char", "repeated-prefix share"):
        t.add_column(col, justify="right")
    t.add_row(str(w["prompts"]), f"{w['chars']:,}", f"{w['tokens']:,}", f"{w['tokens_per_prompt']:.0f}",
              f"{w['tokens_per_char']:.3f}", f"{w['repeated_prefix_share']:.1%}")
    console.print(t)
    console.print(f"  {prefix_line(report)}", highlight=False)
    if "kernels" in report:
        console.print(f"  {summary(report['kernels'])}", highlight=False)

    s = report["split"]
    t = Table(title=f"2. TTFT vs ITL ({report['new_tokens']} new tokens): {report['dominant']}-dominated",
              title_justify="left")
    for col in ("TTFT ms", "mean ITL ms", "ITL p90 ms", "end-to-end ms", "prefill share", "decode share"):
        t.add_column(col, justify="right")
    t.add_row(f"{s['ttft_ms']:.1f}", f"{s['itl_ms']:.2f}", f"{s['itl_p90_ms']:.2f}", f"{s['e2e_ms']:.0f}",
              f"{s['prefill_share']:.1%}", f"{s['decode_share']:.1%}")
    console.print(t)

    r = report["roofline"]
    t = Table(title=f"3. Bound (measured peaks: {r['peak_gflops']:.1f} GFLOP/s fp32 matmul, "
                    f"{r['bandwidth_gbs']:.1f} GB/s read; ridge {r['decode']['ridge_flops_per_byte']:.1f} FLOP/B)",
              title_justify="left")
    for col in ("path", "GFLOP/token", "bytes/token", "FLOP/byte", "bound", "achieved", "roofline", "x slower"):
        t.add_column(col, justify="right")
    for path in ("prefill", "decode"):
        p = r[path]
        achieved = f"{p['achieved_gflops']:.1f} GFLOP/s" if p["bound"] == "compute" else f"{p['achieved_gbs']:.1f} GB/s"
        roof = (f"{p['roofline_gflops']:.1f} GFLOP/s" if p["bound"] == "compute"
                else f"{p['roofline_gflops'] * 1e9 / p['intensity_flops_per_byte'] / 1e9:.1f} GB/s")
        t.add_row(path, f"{p['flops_per_token'] / 1e9:.3f}", _mb(p["bytes_per_token"]),
                  f"{p['intensity_flops_per_byte']:.1f}", p["bound"], achieved, roof, f"{p['times_roofline']:.1f}")
    console.print(t)
    d = r["decode"]
    console.print(f"  decode bytes/token = weights {_mb(d['weight_bytes'])} + KV {_mb(d['kv_bytes'])} at a mean "
                  f"context of {d['context_tokens']:.0f} tokens", highlight=False)

    k = report["kv_pressure"]
    t = Table(title=f"4. KV pressure at {k['context_tokens']} tokens of context, budget {_mb(k['budget_bytes'])}",
              title_justify="left")
    for col in ("KV cache", "bytes/token", "per sequence", "sequences that fit"):
        t.add_column(col, justify="right")
    for kind, row in k["kinds"].items():
        label = f"fp ({k['activation_dtype']})" if kind == "fp" else kind
        t.add_row(label, f"{row['bytes_per_token']:,.0f}", _mb(row["bytes_per_sequence"]),
                  f"{row['sequences_in_budget']:,}")
    console.print(t)

    t = Table(title="5. What-ifs, measured side by side (ranked by end-to-end time)", title_justify="left")
    for col in ("option", "TTFT ms", "mean ITL ms", "end-to-end ms", "vs baseline", "KL", "ppl change",
                "same tokens"):
        t.add_column(col, justify="right")
    rows = report["whatifs"]["rows"]
    base = rows["baseline"]["e2e_ms"]
    for name in report["whatifs"]["ranking"]:
        row = rows[name]
        t.add_row(name, f"{row['ttft_ms']:.1f}", f"{row['itl_ms']:.2f}", f"{row['e2e_ms']:.0f}",
                  f"{base / row['e2e_ms']:.2f}x", f"{row['kl']:.4f}", f"{row['ppl_change']:+.1%}",
                  f"{row['token_agreement']:.0%}")
    console.print(t)
    for note in report["whatifs"]["notes"]:
        console.print(f"  {note}", highlight=False)
    rec = report["recommendation"]
    console.print(f"[bold]6. Recommendation: {rec['option']}[/] - {rec['why']}", highlight=False)
    console.print(f"   apply: [bold]{rec['command']}[/]", highlight=False)
    if rec.get("explain"):
        console.print(f"   ({rec['explain']})", highlight=False)


def plot_split(report: dict, path) -> None:
    """Stacked bars per option: mean TTFT and mean decode time of one request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["whatifs"]["rows"]
    names = report["whatifs"]["ranking"]
    ttft = [rows[n]["ttft_ms"] for n in names]
    decode = [rows[n]["e2e_ms"] - rows[n]["ttft_ms"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(names) + 1.5))
    ax.barh(names, ttft, label="TTFT (prefill)")
    ax.barh(names, decode, left=ttft, label="decode (sum of ITLs)")
    ax.invert_yaxis()
    ax.set_xlabel("ms per request")
    ax.set_title(f"{report['model']}: {report['prompt_tokens']:.0f} prompt + {report['new_tokens']} new tokens "
                 f"({report['dominant']}-dominated)", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
