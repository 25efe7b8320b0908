"""Read the JSONL results store: one result per line; a line that does not parse (a run killed mid-write on a
filesystem without atomic appends, a hand edit) is skipped and counted, never fatal."""

import json
from pathlib import Path

from toolkit.errors import DataError


def read_store(path: str | Path) -> tuple[list[dict], int]:
    """(results in the order written, number of unreadable lines skipped)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"results store {path} does not exist",
                        "run `specquant eval` / `specquant bench` first, or give store=PATH")
    results, bad = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(record, dict) and record.get("kind") in ("eval", "bench"):
            results.append(record)
        else:
            bad += 1
    return results, bad
