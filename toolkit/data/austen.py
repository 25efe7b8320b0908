"""The austen source: Jane Austen's novels, a document per chapter, read from the R package janeaustenr as
Debian ships it (r-cran-janeaustenr), whose novels sit in an R lazy-load database."""

import re
import zlib
from pathlib import Path

from toolkit.data.debian import DebianPackage
from toolkit.data.documents import Document
from toolkit.data.splits import CALIBRATION, EVALUATION, OTHER
from toolkit.errors import DataError

_AUSTEN_DB = "usr/lib/R/site-library/janeaustenr/data/Rdata"
_NOVELS = {  # R variable -> title, in janeaustenr's own order
    "sensesensibility": "Sense & Sensibility", "prideprejudice": "Pride & Prejudice",
    "mansfieldpark": "Mansfield Park", "emma": "Emma", "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
_SPLITS = {"Sense & Sensibility": CALIBRATION, "Emma": CALIBRATION, "Persuasion": EVALUATION}
_CHAPTER = re.compile(r"^\s*chapter\s+([0-9]+|[ivxlc]+)\.?\s*$", re.I)
_NOT_PROSE = re.compile(r"^\s*(volume\s+[ivx0-9]+|the end|finis)\s*$", re.I)


def split_of(novel: str) -> str:
    """A novel's split (a chapter's key is its novel): calibration, evaluation or, for the rest, other."""
    return _SPLITS.get(novel, OTHER)


def _read_r_lazyload(stem: Path) -> dict[str, object]:
    """Read an R lazy-load database (stem.rdx + stem.rdb), which `rdata` cannot open itself.
    The .rdx is an ordinary RDS file: a list whose `variables` maps each name to (offset, length) in the
    .rdb; each .rdb entry is a 4-byte big-endian length then a zlib stream of one serialized R object."""
    import rdata

    index = rdata.read_rds(stem.with_suffix(".rdx"))
    if int(index["compressed"][0]) != 1:  # TRUE (1) is zlib; 2 and 3 are bzip2 and xz
        raise DataError(f"{stem}.rdb uses a compression other than zlib", fix="report this; only zlib is read")
    blob = stem.with_suffix(".rdb").read_bytes()
    objects = {}
    for name, (offset, length) in index["variables"].items():
        entry = blob[int(offset):int(offset) + int(length)]
        raw = zlib.decompress(entry[4:])
        if len(raw) != int.from_bytes(entry[:4], "big"):
            raise DataError(f"{stem}.rdb entry {name} is truncated", fix="fetch the package again")
        objects[str(name)] = rdata.conversion.convert(rdata.parser.parse_data(raw, extension=".rds"))
    return objects


def _reflow(lines: list[str]) -> str:
    """Join the hard-wrapped lines of Project Gutenberg text into one line per paragraph."""
    paragraphs, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    return "\n\n".join(paragraphs)


def _chapters(novel: str, lines: list[str]) -> list[Document]:
    """One document per chapter; front matter (title page, preface) before chapter one is dropped."""
    chapters: list[list[str]] = []
    for line in lines:
        if _CHAPTER.match(line):
            chapters.append([])
        elif chapters and not _NOT_PROSE.match(line):
            chapters[-1].append(line)
    # Emma restarts chapter numbers in each volume, so titles number chapters through the whole novel
    return [Document(f"{novel}, chapter {i}", _reflow(body), novel) for i, body in enumerate(chapters, 1)]


def _parse(root: Path) -> list[Document]:
    novels = _read_r_lazyload(root / _AUSTEN_DB)
    return [doc for var, title in _NOVELS.items() for doc in _chapters(title, [str(s) for s in novels[var]])]


PACKAGE = DebianPackage("r-cran-janeaustenr", _AUSTEN_DB + ".rdb", _parse)
