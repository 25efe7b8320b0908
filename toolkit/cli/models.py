"""specquant models list | fetch NAME | verify NAME."""

import sys

from rich.console import Console
from rich.table import Table

from toolkit import paths
from toolkit.errors import SpecquantError
from toolkit.models import (
    DEFAULT_MODEL,
    fetch,
    get_spec,
    is_cached,
    list_models,
    verify,
)

console = Console(width=None if sys.stdout.isatty() else 150)


def _size(n: int | None) -> str:
    if not n:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def show_list() -> None:

    table = Table(title=f"models (cache: {paths.models_dir()})")
    for column in ("name", "params", "cached", "size on disk", "description"):
        table.add_column(column)
    for m in list_models():
        name = m["name"] + (" (default)" if m["name"] == DEFAULT_MODEL else "") + (" [opt-in]" if m.get("opt_in") else "")
        params = f"{m['params'] / 1e6:.0f}M" if m.get("params") else "-"
        table.add_row(name, params, "yes" if m["cached"] else "no", _size(m.get("size_bytes")),
                      m.get("description", ""))
    console.print(table)
    console.print("Also: model=/path/to/checkpoint, or a hub id when online.", style="dim")


def run(cfg) -> None:

    name = cfg.model.name
    if cfg.action == "list":
        show_list()
    elif cfg.action == "fetch":
        get_spec(name)  # unknown names fail here, with suggestions
        path = fetch(name, force=cfg.force)
        console.print(f"{name}: cached at {path}")
    elif cfg.action == "verify":

        if not is_cached(name):
            raise SpecquantError(f"{name} is not cached", f"specquant models fetch {name}")
        verify(paths.models_dir() / name)
        console.print(f"{name}: every file matches its checksum")
    else:
        raise SpecquantError(f"unknown action {cfg.action!r}", "use: specquant models list | fetch NAME | verify NAME")
