"""Rows -> the Markdown body of BENCHMARKS.md. Every number cell carries a protocol mark ([q1], [s1]) that points
to the protocol it was measured under, listed under the table: the protocol sits beside every number."""


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def protocol_marks(rows) -> tuple[dict, dict]:
    quality, speed = {}, {}
    for row in rows:
        if row.quality_protocol:
            quality.setdefault(row.quality_protocol, f"q{len(quality) + 1}")
        if row.speed_protocol:
            speed.setdefault(row.speed_protocol, f"s{len(speed) + 1}")
    return quality, speed


COLUMNS = ["configuration", "precision", "ppl (ref)", "Δppl", "KL", "top-1", "cloze (ref)", "mc (ref)", "gen prefix",
           "decode tok/s", "TTFT ms", "ITL ms", "x transformers", "x llama.cpp", "TTFT x llama.cpp", "x no-spec",
           "accepted"]


def cells(row, qmarks: dict, smarks: dict) -> list[str]:
    q, s = row.quality, row.speed
    qm = f" [{qmarks[row.quality_protocol]}]" if row.quality_protocol else ""
    sm = f" [{smarks[row.speed_protocol]}]" if row.speed_protocol else ""

    def qv(text):
        return text + qm if text != "—" else text

    def sv(text):
        return text + sm if text != "—" else text

    ppl = f"{q['ppl']:.3f} ({q['ref_ppl']:.3f})" if "ppl" in q else "—"
    cloze = f"{q['cloze_accuracy']:.3f} ({q['ref_cloze_accuracy']:.3f})" if "cloze_accuracy" in q else "—"
    mc = f"{q['mc_accuracy']:.3f} ({q['ref_mc_accuracy']:.3f})" if "mc_accuracy" in q else "—"
    increase = row.ppl_increase
    itl = s.get("itl_ms") or {}
    itl_text = _fmt(itl.get("p50"), ".1f") if "p50" in itl else (f"{itl['mean']:.1f} mean" if "mean" in itl else "—")
    accepted = (f"{s['acceptance_rate']:.2f} ({s['mean_accepted']:.1f}/round)" if "acceptance_rate" in s else "—")
    delta = _fmt(None if increase is None else 100 * increase, "+.2f") + ("%" if increase is not None else "")
    nospec = _fmt(s.get("speedup_vs_nospec"), ".2f") + ("" if s.get("identical_outputs", True) else " (outputs differ)")
    return [row.label, row.precision or "—", qv(ppl), qv(delta), qv(_fmt(q.get("kl"), ".4f")),
            qv(_fmt(q.get("top1_agreement"), ".3f")), qv(cloze), qv(mc), qv(_fmt(q.get("gen_prefix_match"), ".3f")),
            sv(_fmt(s.get("decode_tokens_per_s"), ".1f")), sv(_fmt(s.get("ttft_ms"), ".1f")), sv(itl_text),
            sv(_fmt(s.get("speedup_vs_baseline"), ".2f")), sv(_fmt(s.get("speedup_vs_llamacpp"), ".2f")),
            sv(_fmt(s.get("ttft_speedup_vs_llamacpp"), ".2f")), sv(nospec), sv(accepted)]


def render_markdown(rows, title: str = "Benchmarks", note: str = "", beside_llamacpp: str = "") -> str:
    """The whole page; `beside_llamacpp`: the medians table (toolkit.report.llamacpp), a section of its own."""
    qmarks, smarks = protocol_marks(rows)
    lines = [f"# {title}", ""]
    if note:
        lines += [note, ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells(row, qmarks, smarks)) + " |" for row in rows]
    legend = ("Δppl: perplexity over the reference's on the same windows. ref: the reference model (the float "
              "model in fp32 with a full-precision KV cache). Rows with speculation show the quality of their target "
              "(the same weights and cache without it): greedy speculative decoding emits exactly the target's "
              "tokens, checked in the x no-spec column. ITL: p50 of the per-token gaps; for speculative rows "
              "the mean (their tokens arrive in bursts). x transformers: decode tokens/s over transformers "
              "`generate()` (fp32) interleaved in the same run. x llama.cpp: decode tokens/s over llama.cpp's "
              "(llama-cpp-python, on the engine's own weights exported as GGUF where its row says \"same weights\", "
              "else the model's GGUF requantized to the nearest type) interleaved in the same run on the same prompt "
              "token ids and threads; TTFT x llama.cpp: "
              "llama.cpp's TTFT over the engine's. A llama.cpp row follows each row whose run included it: that "
              "run's llama.cpp figures, its greedy token agreement with the engine, no quality figures (even on the "
              "same weights its arithmetic differs: q8 activations). precision: what the engine computed in (weights / activations). "
              "x no-spec: wall time of the same engine, weights "
              "and KV cache without speculation over the time with it, interleaved in the same run, outputs "
              "compared token for token. accepted: the share of drafted tokens the target accepted (mean accepted "
              "per verify round).")
    lines += ["", legend]
    if beside_llamacpp:
        lines += ["", "## Beside llama.cpp (medians of repeats)", "", beside_llamacpp]
    lines += ["", "## Protocols", ""]
    lines += [f"- **[{mark}]** {text}" for text, mark in qmarks.items()]
    lines += [f"- **[{mark}]** {text}" for text, mark in smarks.items()]
    return "\n".join(lines) + "\n"
