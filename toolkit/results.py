"""A result: one dict per bench/eval run holding the resolved config, the figures, the machine and the git
revision, written atomically as JSON, and appended as one line to the results store (JSONL) that `specquant report`
and `specquant recommend` read."""

import fcntl
import json
import os
import subprocess
import time
from pathlib import Path

from toolkit.errors import SpecquantError
from toolkit.fileio import write_json_atomic
from toolkit.paths import home


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


def default_store() -> Path:
    return home() / "results.jsonl"


def store_path(store: str | None) -> Path | None:
    """`store=` -> the JSONL file: null = $SPECQUANT_STORE if set (tests point it at a throwaway file), else
    $SPECQUANT_HOME/results.jsonl; "none"/"false" = no store."""
    if store is None or store == "":
        store = os.environ.get("SPECQUANT_STORE")
        if not store:
            return default_store()
    if str(store).lower() in ("none", "false", "off"):
        return None
    return Path(store).expanduser()


def append_to_store(result: dict, store: str | None = None) -> Path | None:
    """Append `result` as one JSON line. The line is written with a single write() on an O_APPEND descriptor
    under an exclusive lock, so concurrent runs (a hydra multirun, two shells) never interleave or tear lines;
    a reader skips a torn last line (see toolkit.report.store). Returns the store's path (None: no store)."""
    path = store_path(store)
    if path is None:
        return None
    if path.is_dir():
        raise SpecquantError(f"store={path} is a directory", "give a .jsonl file path, e.g. store=results.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(result, default=str, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)  # closing releases the lock
    return path
