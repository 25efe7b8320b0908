"""specquant data list | fetch NAME | show NAME."""

import sys

from rich.console import Console
from rich.table import Table

from toolkit import paths
from toolkit.data import fetch, list_datasets, load_splits
from toolkit.errors import SpecquantError

console = Console(width=None if sys.stdout.isatty() else 150)


def show_list() -> None:

    table = Table(title=f"datasets (cache: {paths.data_dir()})")
    for column in ("name", "cached", "documents", "characters", "description"):
        table.add_column(column)
    for row in list_datasets():
        cached = "yes" if row["cached"] else ("no" if not row["problem"] else f"unusable: {row['problem']}")
        docs = ", ".join(f"{k} {v}" for k, v in (row["documents"] or {}).items()) or "-"
        chars = ", ".join(f"{k} {v:,}" for k, v in (row["characters"] or {}).items()) or "-"
        table.add_row(row["name"], cached, docs, chars, row["description"])
    console.print(table)
    console.print("Also: data=/path/to/file.txt|.jsonl|.parquet, or a hub dataset when online.", style="dim")


def show(name: str) -> None:

    splits = load_splits(name)
    for split, ds in splits.items():
        chars = sum(map(len, ds["text"]))
        console.print(f"[bold]{split}[/]: {len(ds)} documents, {chars:,} characters")
        if len(ds):
            console.print(f"  first: {ds[0]['title']!r}: {ds[0]['text'][:200]!r}", highlight=False)


def run(cfg) -> None:

    if cfg.action == "list":
        show_list()
    elif cfg.action == "fetch":
        fetch(cfg.data.name)
        console.print(f"{cfg.data.name}: ready")
    elif cfg.action == "show":
        show(cfg.data.name)
    else:
        raise SpecquantError(f"unknown action {cfg.action!r}", "use: specquant data list | fetch NAME | show NAME")
