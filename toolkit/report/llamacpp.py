"""The "Beside llama.cpp" table of BENCHMARKS.md and the README: every bench result that ran llama.cpp with three or
more repeats (`specquant bench baseline=llamacpp repeats=3`, as eval/sweep.sh's llama.cpp phase does), one row per
weights x engine precision x speculation x prompt set x prompt length (the latest result wins), each figure the
median of the per-repeat ratios (toolkit/bench/repeats.py) with their range."""

from toolkit.report.rows import config_key, gguf_type, kv_type_text, model_label

MIN_REPEATS = 3  # fewer repeats give a pooled ratio only: BENCHMARKS.md's main table shows those
COLUMNS = ["weights", "llama.cpp", "engine", "speculation", "prompts", "prompt tokens", "decode x llama.cpp",
           "TTFT x llama.cpp", "greedy = no-spec", "repeats"]


def side_by_side(results: list[dict]) -> list[dict]:
    """The results to show, latest per configuration and prompt length, in order of first appearance."""
    latest = {}
    for result in results:
        ratios = result.get("vs_llamacpp") or {}
        if result.get("kind") != "bench" or ratios.get("repeats", 0) < MIN_REPEATS:
            continue
        model, kv, spec, variant = config_key(result)
        latest[(model, kv, spec, variant, str(result.get("prompts")), result.get("prompt_tokens"))] = result
    return list(latest.values())


def _range(median: float, runs: list[float]) -> str:
    return f"**{median:.2f}** ({min(runs):.2f}-{max(runs):.2f})"


def _cells(result: dict) -> list[str]:
    model, kv, spec, variant = config_key(result)
    ratios = result["vs_llamacpp"]
    engine = variant.removeprefix("engine.") if variant else "native_dot=fp32 (exact)"
    if kv != "fp":
        engine += f", kv={kv}"
    same = result.get("identical_runs", "—") if spec != "none" else "—"
    theirs = gguf_type(result["llamacpp"])
    if kv_type_text(result["llamacpp"]) != "f16":
        theirs += f", KV {kv_type_text(result['llamacpp'])}"
    return [model_label(model), theirs, engine, spec, str(result.get("prompts", "?")),
            str(result.get("prompt_tokens", "?")), _range(ratios["decode_median"], ratios["decode_runs"]),
            _range(ratios["ttft_median"], ratios["ttft_runs"]), same, str(ratios["repeats"])]


def render_side_by_side(results: list[dict]) -> str:
    """The table's Markdown with its legend; "" when no result qualifies."""
    shown = side_by_side(results)
    if not shown:
        return ""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] * 6 + ["---:"] * 4) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in _cells(r)) + " |" for r in shown]
    cpus = sorted({(r.get("machine") or {}).get("cpu", "?") for r in shown})
    flags = sorted({" ".join((r.get("machine") or {}).get("cpu_flags") or []) for r in shown})
    legend = (f"Each ratio is ours over llama.cpp's (decode tokens/s; for TTFT, its time over ours: > 1 = we are "
              f"faster), measured per repeat with both engines taking turns on the same prompt token ids, same "
              f"threads; the figure is the median over the repeats, its range in brackets. A speculative row is our "
              f"speculative decode against llama.cpp's plain decode; its greedy = no-spec column counts runs whose "
              f"tokens equal the engine's without speculation. llama.cpp runs the engine's own weights exported "
              f"as GGUF (`specquant export format=gguf`), flash attention on, its KV cache at the engine's bits (f16 "
              f"beside kv=fp, q8_0 beside kv=int8, q4_0 beside kv=int4, named in its column where not f16). CPU: "
              f"{', '.join(cpus)} ({'; '.join(flags) or 'flags not recorded'}). Written by `specquant report`.")
    return "\n".join(lines + ["", legend])

