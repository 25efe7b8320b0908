"""The model cache: one entry per model, written atomically with a manifest, and checked against it.

A cache entry is `models_dir()/NAME/` holding the saved model + tokenizer, `source.gguf` (the original file,
kept for llama.cpp and friends) and `manifest.json` (sizes + xxh3_128 of every file). The manifest is written
last, inside the temp directory, so its presence means the entry is complete.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from .. import __version__
from ..errors import ModelError
from ..fileio import checksum_files, file_problem, write_json_atomic
from ..paths import models_dir
from .atomic_dir import write_dir_atomic
from .fetch_errors import refetch_fix
from .registry import DEFAULT_MODEL, REGISTRY

MANIFEST = "manifest.json"
SOURCE_GGUF = "source.gguf"
MANIFEST_FORMAT = 1


def write_entry(final: Path, populate: Callable[[Path], dict | None], *, name: str, force: bool = False) -> Path:
    """Atomically create cache entry `final`: populate(tmp) writes the files, then the manifest goes in, then
    tmp is renamed to `final`. On any failure (KeyboardInterrupt included) tmp is removed. Without force, a
    complete entry another fetch published meanwhile is kept.

    populate may return extra manifest fields. A `source.gguf` it leaves in tmp is recorded by size only,
    because hashing it at every load would be wasted time (the checkpoint never reads it).
    """

    def build(tmp: Path) -> None:
        extra = populate(tmp) or {}
        manifest = {
            "format": MANIFEST_FORMAT,
            "name": name,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": _versions(),
            "dtype": "float32",
            **extra,
            "files": checksum_files(tmp, exclude={MANIFEST, SOURCE_GGUF}),
        }
        if (tmp / SOURCE_GGUF).is_file():
            manifest["source_gguf"] = {"path": SOURCE_GGUF, "size": (tmp / SOURCE_GGUF).stat().st_size}
        write_json_atomic(tmp / MANIFEST, manifest, sort_keys=True)

    write_dir_atomic(final, build, keep_if=None if force else MANIFEST)
    return final


def verify(entry_dir: Path) -> None:
    """Raise ModelError unless every file the manifest lists is present with its recorded size and hash."""
    entry_dir = Path(entry_dir)
    manifest = read_manifest(entry_dir)
    name = manifest.get("name") or entry_dir.name
    for rel, record in manifest.get("files", {}).items():
        _check_file(entry_dir, rel, record, name, hashed=True)
    if "source_gguf" in manifest:
        record = manifest["source_gguf"]
        _check_file(entry_dir, record["path"], record, name, hashed=False)


def read_manifest(entry_dir: Path) -> dict:
    path = Path(entry_dir) / MANIFEST
    name = Path(entry_dir).name
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"cache entry {entry_dir} has no {MANIFEST} (incomplete entry)", refetch_fix(name)) from None
    except (OSError, ValueError) as exc:
        raise ModelError(f"cache entry {entry_dir}: {MANIFEST} is unreadable ({exc})", refetch_fix(name)) from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ModelError(f"cache entry {entry_dir}: {MANIFEST} has no file list", refetch_fix(name))
    return manifest


def is_cached(name: str) -> bool:
    """True when a complete entry exists (the manifest is written last, so its presence means complete)."""
    return (models_dir() / name / MANIFEST).is_file()


def cache_info(name: str) -> dict:
    path = models_dir() / name
    cached = is_cached(name)
    return {"name": name, "path": str(path), "cached": cached, "size_bytes": _dir_size(path) if cached else 0}


def list_models() -> list[dict]:
    """One row per registry model, for `specquant models list`."""
    rows = []
    for spec in REGISTRY.values():
        info = cache_info(spec.name)
        rows.append(
            {
                "name": spec.name,
                "description": spec.description,
                "cached": info["cached"],
                "size_bytes": info["size_bytes"],
                "params": spec.params,
                "opt_in": spec.opt_in,
                "default": spec.name == DEFAULT_MODEL,
                "approx_fp32_bytes": spec.approx_fp32_bytes,
            }
        )
    return rows


def _check_file(entry_dir: Path, rel: str, record: dict, name: str, hashed: bool) -> None:
    problem = file_problem(entry_dir / rel, record, hashed)
    if problem:
        raise ModelError(f"cache entry {entry_dir} is corrupt/truncated: file {rel} {problem}", refetch_fix(name))


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _versions() -> dict:
    out = {"specquant": __version__}
    for dist in ("transformers", "torch", "safetensors", "gguf"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out
