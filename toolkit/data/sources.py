"""Named text sources for calibration and evaluation, served as `datasets` objects with disjoint splits: the
registry of named datasets, and loading any source (named, a local file, a hub dataset) by one name.

Sources built from Debian packages are fetched once (`specquant data fetch NAME`) and cached as parquet
under data_dir()/NAME/ with a checksum, so every later load is offline, fast and verified.
How documents are split lives in splits.py; each kind of source has a module of its own.
"""

from __future__ import annotations

import difflib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.data import austen, pydocs
from toolkit.data.builtin import pydoc_documents, stdlib_documents
from toolkit.data.cache import (
    cache_dir,
    cache_problem,
    is_present,
    read_cache,
    write_cache,
)
from toolkit.data.debian import DebianPackage, package_root
from toolkit.data.documents import Document, paragraphs
from toolkit.data.hub import hub_splits, is_hub_name
from toolkit.data.local_files import (
    LOCAL_SUFFIXES,
    TXT_CHUNK_CHARS,
    checked_file,
    jsonl_records,
    local_documents,
    looks_like_path,
    read_text_file,
)
from toolkit.data.progress import stage_progress
from toolkit.data.splits import (
    ALL,
    CALIBRATION,
    EVALUATION,
    EVALUATION_SHARE,
    OTHER,
    assign_splits,
    drop_contained,
    hash_split,
    to_splits,
)
from toolkit.errors import DataError

if TYPE_CHECKING:  # `datasets` takes a second to import; only the functions that build datasets pay for it
    import datasets

# The text layer's public names, importable from here as before the modules above were split out of this one
__all__ = [
    "ALL", "CALIBRATION", "DATASETS", "EVALUATION", "EVALUATION_SHARE", "LOCAL_SUFFIXES", "OTHER", "TXT_CHUNK_CHARS",
    "DebianPackage", "Document", "SourceSpec", "assign_splits", "checked_file", "fetch", "hash_split", "is_cached",
    "jsonl_records", "list_datasets", "load_splits", "load_text", "looks_like_path", "paragraphs", "read_text_file",
]


@dataclass(frozen=True)
class SourceSpec:
    name: str
    description: str
    obtained: str  # how the text is obtained, for `specquant data list`
    documents: Callable[[], list[Document]] = field(repr=False)
    split_of: Callable[[str], str] = field(repr=False, default=hash_split)
    debian: DebianPackage | None = None

    @property
    def needs_fetch(self) -> bool:
        return self.debian is not None


def _fetched_source(name: str, description: str, obtained: str, package: DebianPackage,
                    split_of: Callable[[str], str] = hash_split) -> SourceSpec:
    """A source read from the cache that `fetch` fills from a Debian package."""
    return SourceSpec(name, description, obtained, lambda: read_cache(name, package.package), split_of, package)


DATASETS: dict[str, SourceSpec] = {
    spec.name: spec
    for spec in (
        SourceSpec("pydoc", "Python's topic help (the language reference prose behind help('TOPIC'))",
                   "built in: pydoc_data.topics from the running Python", pydoc_documents),
        SourceSpec("stdlib-code", "the Python standard library's own .py files, one document per file (tests excluded)",
                   "built in: the running Python's stdlib folder", stdlib_documents),
        _fetched_source("austen", "Jane Austen's novels, a document per chapter; calibration: Sense & Sensibility + "
                        "Emma, evaluation: Persuasion, other: the rest",
                        "Debian package r-cran-janeaustenr (apt-get download; read from its R data files)",
                        austen.PACKAGE, austen.split_of),
        _fetched_source("pydocs", "the Python 3.11 documentation, a document per section (info node)",
                        "Debian package python3.11-doc (apt-get download; its GNU info manual)", pydocs.PACKAGE),
    )
}


def _spec(name: str) -> SourceSpec:
    if name not in DATASETS:
        raise _unknown(name)
    return DATASETS[name]


def _unknown(name: str) -> DataError:
    close = difflib.get_close_matches(name, DATASETS, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return DataError(f"unknown dataset {name!r}",
                     fix=f"{hint}known datasets: {', '.join(DATASETS)}; or give a {', '.join(LOCAL_SUFFIXES)} file, "
                         "or a Hugging Face hub dataset org/name")


def load_splits(name_or_path: str | os.PathLike) -> datasets.DatasetDict:
    """All splits of a named dataset, a local file (one split, "all") or a hub dataset; columns title, text."""
    source = os.fspath(name_or_path)
    if source in DATASETS:
        spec = DATASETS[source]
        docs = drop_contained(spec.documents())
        return to_splits(docs, assign_splits(docs, spec.split_of))
    if looks_like_path(source):
        docs = local_documents(Path(source))
        return to_splits(docs, [ALL] * len(docs), names=(ALL,))
    if is_hub_name(source):
        return hub_splits(source, offline_datasets=DATASETS)
    raise _unknown(source)


def load_text(name_or_path: str | os.PathLike, split: str = EVALUATION) -> datasets.Dataset:
    """One split of a dataset as a `datasets.Dataset` with columns title, text.
    A local file has no splits: it is returned whole whichever split is asked for."""
    splits = load_splits(name_or_path)
    if ALL in splits:
        return splits[ALL]
    if split not in splits:
        raise DataError(f"dataset {os.fspath(name_or_path)} has no split {split!r}",
                        fix=f"use one of: {', '.join(splits)}")
    return splits[split]


def fetch(name: str, *, force: bool = False, progress: bool = True) -> Path | None:
    """Download and cache a dataset that needs it; returns its cache folder (None for built-in sources).
    A cache that is intact is kept unless `force`; one that is corrupt or stale is fetched again."""
    spec = _spec(name)
    if spec.debian is None:
        return None  # pydoc and stdlib-code ship with Python
    if not force and cache_problem(name) is None:
        return cache_dir(name)
    with (stage_progress(f"fetch {name}", 4, progress) as stage,
          tempfile.TemporaryDirectory(prefix=f"specquant-{name}-") as tmp):
        root, origin = package_root(name, spec.debian, Path(tmp), stage)
        stage("parsing")
        docs = spec.debian.parse(root)
        if not docs:
            raise DataError(f"{origin} held no {name} text", fix="report this: the package layout may have changed")
        stage("writing cache")
        return write_cache(name, docs, origin)


def is_cached(name: str) -> bool:
    """Whether `name` can be loaded without fetching (always true for built-in sources)."""
    return _spec(name).debian is None or is_present(name)


def list_datasets() -> list[dict]:
    """A row per named dataset for `specquant data list`. Counts and size (UTF-8 bytes of text) need the
    text at hand, so they are None until a dataset is fetched; `problem` says why a cache is unusable."""
    rows = []
    for spec in DATASETS.values():
        row = {"name": spec.name, "description": spec.description, "obtained": spec.obtained,
               "needs_fetch": spec.needs_fetch, "cached": is_cached(spec.name), "size": None, "documents": None,
               "characters": None, "problem": None}
        if row["cached"]:
            try:
                splits = load_splits(spec.name)
            except DataError as e:
                row.update(cached=False, problem=e.problem)
            else:
                row["documents"] = {name: len(ds) for name, ds in splits.items()}
                row["characters"] = {name: sum(map(len, ds["text"])) for name, ds in splits.items()}
                row["size"] = sum(len(t.encode()) for ds in splits.values() for t in ds["text"])
        rows.append(row)
    return rows
