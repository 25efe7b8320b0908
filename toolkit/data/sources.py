"""Named text sources for calibration and evaluation, served as `datasets` objects with disjoint splits.

Every source is a list of documents (title, text, key); a document's key decides its split, so no document
straddles splits. Sources repeat themselves (pydoc topics quote each other's sections, stdlib files copy
code), so documents that repeat a larger one are dropped and documents that share text are kept in one
split: evaluation prompts never quote calibration text.
Sources built from Debian packages are fetched once (`specquant data fetch NAME`) and cached as parquet
under data_dir()/NAME/ with a checksum, so every later load is offline, fast and verified.
"""

from __future__ import annotations

import difflib
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
import tokenize
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from toolkit.errors import DataError
from toolkit.paths import data_dir

if TYPE_CHECKING:  # `datasets` takes a second to import; only the functions that build datasets pay for it
    import datasets

CALIBRATION, EVALUATION, OTHER = "calibration", "evaluation", "other"
ALL = "all"  # the one split of a file the user names: they chose it for the job, so it is used whole
EVALUATION_SHARE = 0.2
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
TXT_CHUNK_CHARS = 4000  # a long .txt becomes paragraph-aligned chunks of about this size


class Document(NamedTuple):
    title: str
    text: str
    key: str  # what decides the split: a topic, a file path, a novel


def hash_split(key: str) -> str:
    """Assign a key to a split by a stable hash (not hash(), which is salted per process).
    Each key is placed on its own, so adding documents never moves existing ones between splits."""
    draw = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    return EVALUATION if draw < EVALUATION_SHARE else CALIBRATION


@dataclass(frozen=True)
class DebianPackage:
    package: str
    marker: str  # a file the package installs, relative to /: if present, the package is installed already
    parse: Callable[[Path], list[Document]] = field(repr=False)  # reads documents under an extraction root


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


# ---------------------------------------------------------------------------------------------------
# Building DatasetDicts


def _features():
    import datasets

    return datasets.Features({"title": datasets.Value("string"), "text": datasets.Value("string")})


def _to_splits(docs: list[Document], splits: list[str],
               names: tuple[str, ...] = (CALIBRATION, EVALUATION)) -> datasets.DatasetDict:
    """Group documents by their split. The `names` splits always exist, even empty, so callers can rely on them."""
    import datasets

    columns: dict[str, dict[str, list[str]]] = {name: {"title": [], "text": []} for name in names}
    for doc, split in zip(docs, splits):
        column = columns.setdefault(split, {"title": [], "text": []})
        column["title"].append(doc.title)
        column["text"].append(doc.text)
    features = _features()
    return datasets.DatasetDict({name: datasets.Dataset.from_dict(column, features=features)
                                 for name, column in columns.items()})


_SHARED_BLOCK_CHARS = 100  # shorter blocks ("New in version 3.5.", "pass") recur everywhere and leak nothing
_CONTAINED_SHARE = 0.9


def _shared_blocks(doc: Document) -> set[str]:
    """Text whose repetition in another document ties the two together: long paragraphs, and the whole
    text (the stdlib has identical two-line files)."""
    return {block for block in paragraphs(doc.text) if len(block) >= _SHARED_BLOCK_CHARS} | {doc.text.strip()}


def _holders(docs: list[Document]) -> dict[str, set[int]]:
    """Each shared block -> the documents that hold it."""
    holders: dict[str, set[int]] = defaultdict(set)
    for i, doc in enumerate(docs):
        for block in _shared_blocks(doc):
            holders[block].add(i)
    return holders


def _drop_contained(docs: list[Document]) -> list[Document]:
    """Drop documents that (nearly) repeat part or all of a larger one: pydoc's "try" topic is a section of its
    "compound" topic. The text stays in the corpus, and the larger document is no longer tied through
    them to everything else it quotes (which would lump a third of pydoc into one split)."""
    blocks = [set(paragraphs(doc.text)) for doc in docs]
    holders = _holders(docs)

    def size(i: int) -> tuple[int, str]:
        return len(docs[i].text), docs[i].key

    def contained(i: int) -> bool:
        others = set().union(*(holders[block] for block in _shared_blocks(docs[i]))) - {i}
        total = sum(map(len, blocks[i]))
        return any(size(j) > size(i) and sum(map(len, blocks[i] & blocks[j])) >= _CONTAINED_SHARE * total
                   for j in others)

    return [doc for i, doc in enumerate(docs) if not contained(i)]


def _sharing_groups(docs: list[Document]) -> list[int]:
    """For each document, a group id; documents that share a long block of text (paragraph, copied
    function), directly or through others, get the same one. Union-find over the blocks."""
    parent = list(range(len(docs)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for holding in _holders(docs).values():
        first, *rest = holding
        for i in rest:
            parent[root(i)] = root(first)
    return [root(i) for i in range(len(docs))]


def assign_splits(docs: list[Document], split_of: Callable[[str], str]) -> list[str]:
    """Each document's split: its key's, except that documents sharing text stay together, in the split
    most of them would take (ties: calibration). pydoc's topics repeat whole sections of one another and
    stdlib files copy code; split one by one, evaluation prompts would quote calibration text."""
    groups = _sharing_groups(docs)
    votes: dict[int, Counter] = defaultdict(Counter)
    for group, doc in zip(groups, docs):
        votes[group][split_of(doc.key)] += 1
    winner = {group: max(tally, key=lambda split: (tally[split], split == CALIBRATION, split))
              for group, tally in votes.items()}
    return [winner[group] for group in groups]


# ---------------------------------------------------------------------------------------------------
# pydoc: the topic help that ships inside every CPython


@lru_cache(maxsize=1)
def _pydoc_documents() -> list[Document]:
    from pydoc_data.topics import topics

    return [Document(key, topics[key], key) for key in sorted(topics)]


# ---------------------------------------------------------------------------------------------------
# stdlib-code: the standard library's own .py files

# Test suites, third-party packages and generated tables are not the stdlib code a model should complete;
# pydoc_data is excluded because it is the `pydoc` prose source.
_STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib-dynload",
                     "encodings", "pydoc_data"}


def _stdlib_files(root: Path) -> Iterator[Path]:
    for folder, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _STDLIB_SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(files):
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                yield Path(folder, name)


@lru_cache(maxsize=1)
def _stdlib_documents() -> list[Document]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in _stdlib_files(root):
        try:
            with tokenize.open(path) as f:  # honours PEP 263 encoding cookies
                text = f.read()
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue  # one odd file is not worth failing the corpus over
        if text.strip():
            rel = path.relative_to(root).as_posix()
            docs.append(Document(rel, text, rel))
    return docs


# ---------------------------------------------------------------------------------------------------
# austen: Jane Austen's novels, from the R package janeaustenr as Debian ships it

_AUSTEN_DB = "usr/lib/R/site-library/janeaustenr/data/Rdata"
_NOVELS = {  # R variable -> title, in janeaustenr's own order
    "sensesensibility": "Sense & Sensibility", "prideprejudice": "Pride & Prejudice",
    "mansfieldpark": "Mansfield Park", "emma": "Emma", "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
_AUSTEN_SPLITS = {"Sense & Sensibility": CALIBRATION, "Emma": CALIBRATION, "Persuasion": EVALUATION}
_CHAPTER = re.compile(r"^\s*chapter\s+([0-9]+|[ivxlc]+)\.?\s*$", re.I)
_NOT_PROSE = re.compile(r"^\s*(volume\s+[ivx0-9]+|the end|finis)\s*$", re.I)


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


def _parse_austen(root: Path) -> list[Document]:
    novels = _read_r_lazyload(root / _AUSTEN_DB)
    return [doc for var, title in _NOVELS.items() for doc in _chapters(title, [str(s) for s in novels[var]])]


# ---------------------------------------------------------------------------------------------------
# pydocs: the Python 3.11 documentation as the GNU info file Debian ships

_PYTHON_INFO = "usr/share/info/python3.11.info.gz"
_INFO_NODE = re.compile(r"Node: ([^,\n]+)")
_SKIP_NODES = {"Top", "Index", "Python Module Index"}  # tables of contents and indexes, not prose
_MIN_NODE_CHARS = 200  # a heading with a line under it carries no passage worth keeping
# Cross references read "*note label: anchor." (the period only ends the reference) or "..., anchor," (the
# comma is the sentence's own). Labels may wrap across lines.
_XREF = re.compile(r"\*[Nn]ote\s+(.{1,200}?):\s+[0-9a-f]+([.,])", re.S)
_XREF_SAME = re.compile(r"\*[Nn]ote\s+([^:]{1,200}?)::", re.S)
_UNDERLINE = re.compile(r"^[*=\-.]{3,}\s*$", re.M)


def _clean_info(body: str) -> str:
    # A node's menu and footnotes come last and are lists of links, not prose
    body = re.split(r"\n\* Menu:|\n\s*-{10} Footnotes -{10}", body, maxsplit=1)[0]
    body = _XREF.sub(lambda m: " ".join(m.group(1).split()) + (m.group(2) if m.group(2) == "," else ""), body)
    body = _XREF_SAME.sub(lambda m: " ".join(m.group(1).split()), body)
    body = _UNDERLINE.sub("", body)
    return re.sub(r"\n{3,}", "\n\n", body).strip()


def _parse_python_info(root: Path) -> list[Document]:
    with gzip.open(root / _PYTHON_INFO, "rt", encoding="utf-8") as f:
        chunks = f.read().split("\x1f\n")[1:]  # nodes are separated by the unit separator character
    docs = []
    for chunk in chunks:
        header, _, body = chunk.partition("\n")
        node = _INFO_NODE.search(header)
        if node is None or node.group(1) in _SKIP_NODES:
            continue  # the tag table and local-variables trailer are not nodes
        text = _clean_info(body)
        if len(text) >= _MIN_NODE_CHARS:
            docs.append(Document(node.group(1), text, node.group(1)))
    return docs


# ---------------------------------------------------------------------------------------------------
# The fetched cache: data_dir()/NAME/documents.parquet + manifest.json (written last, so it marks completion)

_CACHE_FILE, _MANIFEST = "documents.parquet", "manifest.json"
_CACHE_FORMAT = 1  # bump when parsing changes, so stale caches are re-fetched rather than trusted


def _cache_dir(name: str) -> Path:
    return data_dir() / name


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_cache(name: str, docs: list[Document], origin: str) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = _cache_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    # temp files in the same folder + os.replace: a reader never sees a half-written file
    tmp = folder / f".{_CACHE_FILE}.{os.getpid()}.tmp"
    pq.write_table(pa.table({k: [getattr(d, k) for d in docs] for k in Document._fields}), tmp)
    manifest = {"format": _CACHE_FORMAT, "origin": origin, "sha256": _sha256(tmp), "documents": len(docs),
                "characters": sum(len(d.text) for d in docs)}
    os.replace(tmp, folder / _CACHE_FILE)
    tmp_manifest = folder / f".{_MANIFEST}.{os.getpid()}.tmp"
    tmp_manifest.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp_manifest, folder / _MANIFEST)
    return folder


def _read_manifest(name: str) -> dict | None:
    try:
        return json.loads((_cache_dir(name) / _MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # present but unreadable: treated as corrupt


def _cache_problem(name: str) -> str | None:
    """Why the cache of `name` cannot be trusted, or None when it is complete and intact."""
    manifest = _read_manifest(name)
    if manifest is None:
        return "not fetched"
    data = _cache_dir(name) / _CACHE_FILE
    if manifest.get("format") != _CACHE_FORMAT:
        return "cached in an older format"
    if not data.is_file() or _sha256(data) != manifest.get("sha256"):
        return "corrupt (checksum mismatch)"
    return None


def _read_cache(name: str) -> list[Document]:
    import pyarrow.parquet as pq

    problem = _cache_problem(name)
    if problem == "not fetched":
        raise DataError(f"dataset {name} is not fetched yet", fix=_fetch_hint(name))
    if problem:
        raise DataError(f"the cached {name} data in {_cache_dir(name)} is {problem}",
                        fix=f"run `specquant data fetch {name}` to fetch it again")
    table = pq.read_table(_cache_dir(name) / _CACHE_FILE).to_pydict()
    return [Document(*row) for row in zip(*(table[k] for k in Document._fields))]


def _fetch_hint(name: str) -> str:
    package = DATASETS[name].debian.package
    return f"run `specquant data fetch {name}` (downloads Debian package {package}; needs the Debian package registry)"


# ---------------------------------------------------------------------------------------------------
# Getting a Debian package's files without installing it (no root needed: apt-get download + dpkg-deb -x)


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True)


def _apt_download(name: str, package: str, workdir: Path) -> Path:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise DataError(f"`specquant data fetch {name}` downloads Debian package {package}, "
                        "but apt-get/dpkg-deb are not available here",
                        fix=f"run it on Debian or Ubuntu with access to the Debian package registry, "
                            f"or install {package} there")
    argv = ["apt-get", "download", "-q", package]
    if os.geteuid() == 0:  # as root apt drops to user _apt, which cannot write into our private temp dir
        argv[2:2] = ["-o", "APT::Sandbox::User=root"]
    result = _run(argv, workdir)
    debs = sorted(workdir.glob(f"{package}_*.deb"))
    if result.returncode != 0 or not debs:
        message = (result.stderr or result.stdout).strip().splitlines()
        reason = message[-1] if message else f"apt-get exited with {result.returncode}"
        raise DataError(f"could not download Debian package {package}: {reason}",
                        fix=f"`specquant data fetch {name}` needs the Debian package registry: check the network, "
                            "run `apt-get update` (as root) and try again")
    return debs[-1]


def _extract(deb: Path, root: Path) -> Path:
    result = _run(["dpkg-deb", "-x", str(deb), str(root)], deb.parent)
    if result.returncode != 0:
        raise DataError(f"could not unpack {deb.name}: {result.stderr.strip()}", fix="run the fetch again")
    return root


@contextmanager
def _progress(title: str, steps: int, enabled: bool) -> Iterator[Callable[[str], None]]:
    """Yield step(description): each call shows a new stage of a fetch on stderr."""
    if not enabled:
        yield lambda description: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn(f"[bold]{title}[/] {{task.description}}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("", total=steps)
        done = iter(range(steps))
        yield lambda description: bar.update(task, completed=next(done, steps), description=description)
        bar.update(task, completed=steps, description="done")


def fetch(name: str, *, force: bool = False, progress: bool = True) -> Path | None:
    """Download and cache a dataset that needs it; returns its cache folder (None for built-in sources).
    A cache that is intact is kept unless `force`; one that is corrupt or stale is fetched again."""
    spec = _spec(name)
    if spec.debian is None:
        return None  # pydoc and stdlib-code ship with Python
    if not force and _cache_problem(name) is None:
        return _cache_dir(name)
    package = spec.debian
    with (_progress(f"fetch {name}", 4, progress) as step,
          tempfile.TemporaryDirectory(prefix=f"specquant-{name}-") as tmp):
        if Path("/", package.marker).is_file():
            step(f"using installed {package.package}")
            root, origin = Path("/"), f"{package.package} (installed)"
        else:
            step(f"downloading {package.package} (apt-get)")
            deb = _apt_download(name, package.package, Path(tmp))
            step(f"unpacking {deb.name}")
            root, origin = _extract(deb, Path(tmp, "root")), deb.name
        step("parsing")
        docs = package.parse(root)
        if not docs:
            raise DataError(f"{origin} held no {name} text", fix="report this: the package layout may have changed")
        step("writing cache")
        return _write_cache(name, docs, origin)


# ---------------------------------------------------------------------------------------------------
# Local files


def checked_file(path: str | os.PathLike) -> Path:
    """The path as a readable regular file, or a DataError saying what is wrong with it."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise DataError(f"{path} is a directory, not a file", fix=f"give one {', '.join(LOCAL_SUFFIXES)} file")
    if not path.is_file():
        raise DataError(f"no such file: {path}", fix="check the path")
    if not os.access(path, os.R_OK):
        raise DataError(f"cannot read {path}: permission denied", fix="check the file's permissions")
    return path


def read_text_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})", fix="save it as UTF-8") from None


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, stripped, empty ones dropped."""
    return [block.strip() for block in re.split(r"\n\s*\n", text) if block.strip()]


def jsonl_records(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a DataError names the first bad line."""
    for lineno, line in enumerate(read_text_file(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise DataError(f"{path} line {lineno} is not valid JSON ({e})",
                            fix="write one JSON object per line") from None
        if not isinstance(record, dict):
            raise DataError(f"{path} line {lineno} is not a JSON object", fix="write one JSON object per line")
        yield lineno, record


def _chunks(blocks: list[str], size: int) -> Iterator[str]:
    """Consecutive blocks joined into chunks of about `size` characters; a longer block stays whole."""
    current: list[str] = []
    for block in blocks:
        if current and sum(map(len, current)) + len(block) > size:
            yield "\n\n".join(current)
            current = []
        current.append(block)
    if current:
        yield "\n\n".join(current)


def _read_txt(path: Path) -> list[Document]:
    chunks = list(_chunks(paragraphs(read_text_file(path)), TXT_CHUNK_CHARS))
    if len(chunks) == 1:
        return [Document(path.name, chunks[0], path.name)]
    return [Document(f"{path.name}#{i}", chunk, str(i)) for i, chunk in enumerate(chunks, 1)]


def _read_jsonl(path: Path) -> list[Document]:
    docs = []
    for lineno, record in jsonl_records(path):
        if not isinstance(record.get("text"), str):
            raise DataError(f"{path} line {lineno} has no string field \"text\"",
                            fix='give each line a "text" field, e.g. {"text": "..."}')
        docs.append(Document(str(record.get("title") or f"{path.name}:{lineno}"), record["text"], str(lineno)))
    return docs


def _read_parquet(path: Path) -> list[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is not a readable parquet file ({e})", fix="check the file") from None
    if "text" not in table.column_names:
        raise DataError(f"{path} has no column \"text\" (it has {', '.join(table.column_names)})",
                        fix='name the column that holds the text "text"')
    texts = table.column("text").to_pylist()
    titles = table.column("title").to_pylist() if "title" in table.column_names else [None] * len(texts)
    return [Document(str(title or f"{path.name}[{i}]"), text, str(i))
            for i, (title, text) in enumerate(zip(titles, texts)) if isinstance(text, str)]


_LOCAL_READERS = dict(zip(LOCAL_SUFFIXES, (_read_txt, _read_jsonl, _read_parquet)))


def _local_documents(path: Path) -> list[Document]:
    path = checked_file(path)
    reader = _LOCAL_READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(f"{path}: unsupported file type {path.suffix or '(none)'}",
                        fix=f"use a {', '.join(LOCAL_SUFFIXES)} file")
    try:
        docs = reader(path)
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}", fix="check the file") from None
    if not docs:
        raise DataError(f"{path} holds no text", fix="check the file")
    return docs


def looks_like_path(source: str) -> bool:
    return (Path(source).expanduser().exists() or source.lower().endswith(LOCAL_SUFFIXES)
            or source.startswith(("/", "./", "../", "~")))


# ---------------------------------------------------------------------------------------------------
# Hugging Face hub datasets (online only): "org/name" or "org/name:config"

_HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+(:[\w.-]+)?$")


def _hub_offline() -> bool:
    return any(os.environ.get(var, "").strip().upper() in {"1", "ON", "YES", "TRUE"}
               for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _hub_splits(source: str) -> datasets.DatasetDict:
    import datasets

    if _hub_offline():
        raise DataError(f"{source} is a Hugging Face hub dataset, but the hub is off (HF_HUB_OFFLINE=1)",
                        fix=f"unset HF_HUB_OFFLINE to download it, or use an offline dataset: {', '.join(DATASETS)}")
    repo, _, config = source.partition(":")
    try:
        raw = datasets.load_dataset(repo, config or None)
    except Exception as e:  # the hub client raises many types; all mean the same thing to the user
        raise DataError(f"could not load hub dataset {source}: {e}",
                        fix="check the name (org/name[:config]) and the network") from None
    # train calibrates; validation (else test) evaluates. A lone split is divided by a stable hash of row index.
    held_out = next((s for s in ("validation", "test") if s in raw), None)
    docs = []
    for split, rows in raw.items():
        if "text" not in rows.column_names:
            raise DataError(f"{source} split {split} has no column \"text\" (it has {', '.join(rows.column_names)})",
                            fix="use a dataset with a text column")
        titles = rows["title"] if "title" in rows.column_names else [f"{source}/{split}/{i}" for i in range(len(rows))]
        docs += [Document(str(t), x, f"{split}/{i}") for i, (t, x) in enumerate(zip(titles, rows["text"])) if x]

    def split_of(key: str) -> str:
        split = key.split("/")[0]
        if held_out is None:
            return hash_split(key)
        return {"train": CALIBRATION, held_out: EVALUATION}.get(split, OTHER)

    return _to_splits(docs, [split_of(doc.key) for doc in docs])  # the hub's own splits, not regrouped


# ---------------------------------------------------------------------------------------------------
# Registry and public API

DATASETS: dict[str, SourceSpec] = {
    spec.name: spec
    for spec in (
        SourceSpec("pydoc", "Python's topic help (the language reference prose behind help('TOPIC'))",
                   "built in: pydoc_data.topics from the running Python", _pydoc_documents),
        SourceSpec("stdlib-code", "the Python standard library's own .py files, one document per file (tests excluded)",
                   "built in: the running Python's stdlib folder", _stdlib_documents),
        SourceSpec("austen", "Jane Austen's novels, a document per chapter; calibration: Sense & Sensibility + Emma, "
                   "evaluation: Persuasion, other: the rest",
                   "Debian package r-cran-janeaustenr (apt-get download; read from its R data files)",
                   lambda: _read_cache("austen"), lambda novel: _AUSTEN_SPLITS.get(novel, OTHER),
                   DebianPackage("r-cran-janeaustenr", _AUSTEN_DB + ".rdb", _parse_austen)),
        SourceSpec("pydocs", "the Python 3.11 documentation, a document per section (info node)",
                   "Debian package python3.11-doc (apt-get download; its GNU info manual)",
                   lambda: _read_cache("pydocs"), hash_split,
                   DebianPackage("python3.11-doc", _PYTHON_INFO, _parse_python_info)),
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
        docs = _drop_contained(spec.documents())
        return _to_splits(docs, assign_splits(docs, spec.split_of))
    if looks_like_path(source):
        docs = _local_documents(Path(source))
        return _to_splits(docs, [ALL] * len(docs), names=(ALL,))
    if _HUB_NAME.match(source):
        return _hub_splits(source)
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


def is_cached(name: str) -> bool:
    """Whether `name` can be loaded without fetching (always true for built-in sources)."""
    spec = _spec(name)
    return spec.debian is None or (_read_manifest(name) is not None and (_cache_dir(name) / _CACHE_FILE).is_file())


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
