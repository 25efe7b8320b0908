"""A result: one dict per bench/eval run holding the resolved config, the figures, the machine and the git
revision, written atomically as JSON (the report layer of a later issue reads only these)."""

import subprocess
import time
from pathlib import Path

from toolkit.errors import SpecquantError
from toolkit.fileio import write_json_atomic


def git_revision() -> str | None:
    """The checkout's commit (with '+dirty' when the tree has changes), or None outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        if rev.returncode:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return rev.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def make_result(kind: str, config: dict, figures: dict, machine: dict) -> dict:
    return {"kind": kind, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_revision": git_revision(),
            "config": config, "machine": machine, **figures}


def write_result(path: str | Path, result: dict) -> Path:
    """Write a result record atomically; a directory given as the path is a clear error."""
    if Path(path).expanduser().is_dir():
        raise SpecquantError(f"out={path} is a directory", "give a file path, e.g. out=bench.json")
    return write_json_atomic(path, result)
