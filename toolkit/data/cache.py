"""The cache of fetched sources: data_dir()/NAME/documents.parquet + manifest.json. The manifest is written
last, so it marks a complete cache, and holds the parquet's checksum, so every load is verified."""

import json
import os
from pathlib import Path

from toolkit.data.documents import Document
from toolkit.errors import DataError
from toolkit.fileio import sha256_file, write_json_atomic
from toolkit.paths import data_dir

_CACHE_FILE, _MANIFEST = "documents.parquet", "manifest.json"
_CACHE_FORMAT = 1  # bump when parsing changes, so stale caches are re-fetched rather than trusted


def cache_dir(name: str) -> Path:
    return data_dir() / name


def write_cache(name: str, docs: list[Document], origin: str) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = cache_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    # a temp file in the same folder + os.replace: a reader never sees a half-written file
    tmp = folder / f".{_CACHE_FILE}.{os.getpid()}.tmp"
    pq.write_table(pa.table({k: [getattr(d, k) for d in docs] for k in Document._fields}), tmp)
    manifest = {"format": _CACHE_FORMAT, "origin": origin, "sha256": sha256_file(tmp), "documents": len(docs),
                "characters": sum(len(d.text) for d in docs)}
    os.replace(tmp, folder / _CACHE_FILE)
    write_json_atomic(folder / _MANIFEST, manifest)
    return folder


def _read_manifest(name: str) -> dict | None:
    try:
        return json.loads((cache_dir(name) / _MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # present but unreadable: treated as corrupt


def is_present(name: str) -> bool:
    """Whether a cache of `name` is there to load, intact or not (a load verifies it)."""
    return _read_manifest(name) is not None and (cache_dir(name) / _CACHE_FILE).is_file()


def cache_problem(name: str) -> str | None:
    """Why the cache of `name` cannot be trusted, or None when it is complete and intact."""
    manifest = _read_manifest(name)
    if manifest is None:
        return "not fetched"
    data = cache_dir(name) / _CACHE_FILE
    if manifest.get("format") != _CACHE_FORMAT:
        return "cached in an older format"
    if not data.is_file() or sha256_file(data) != manifest.get("sha256"):
        return "corrupt (checksum mismatch)"
    return None


def read_cache(name: str, package: str) -> list[Document]:
    """The documents of `name`, fetched from Debian package `package`; a DataError says how to (re)fetch them."""
    import pyarrow.parquet as pq

    problem = cache_problem(name)
    if problem == "not fetched":
        raise DataError(f"dataset {name} is not fetched yet",
                        fix=f"run `specquant data fetch {name}` (downloads Debian package {package}; "
                            "needs the Debian package registry)")
    if problem:
        raise DataError(f"the cached {name} data in {cache_dir(name)} is {problem}",
                        fix=f"run `specquant data fetch {name}` to fetch it again")
    table = pq.read_table(cache_dir(name) / _CACHE_FILE).to_pydict()
    return [Document(*row) for row in zip(*(table[k] for k in Document._fields))]
