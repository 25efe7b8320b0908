"""specquant recommend: the fastest configuration in the store within a perplexity budget, and why."""

from pathlib import Path

from rich.console import Console

from toolkit.errors import InputError
from toolkit.report.recommend import recommend
from toolkit.report.rows import build_rows
from toolkit.report.store import read_store
from toolkit.results import default_store

console = Console()


def run(cfg) -> dict:
    budget = float(cfg.max_ppl_increase)
    if budget < 0:
        raise InputError(f"max_ppl_increase={budget} is negative", "give a fraction, e.g. 0.03 for 3%")
    results, _ = read_store(Path(cfg.store).expanduser() if cfg.store else default_store())
    best, why = recommend(build_rows(results, cfg.data), budget)
    console.print(f"[bold]recommended:[/] {best.label}", highlight=False)
    for line in why:
        console.print(f"  {line}", highlight=False)
    if best.quality_protocol:
        console.print(f"  quality protocol: {best.quality_protocol}", style="dim", highlight=False)
    if best.speed_protocol:
        console.print(f"  speed protocol: {best.speed_protocol}", style="dim", highlight=False)
    return {"model": best.model, "kv": best.kv, "spec": best.spec, "why": why}
