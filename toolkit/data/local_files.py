"""Text files the user names (.txt, .jsonl, .parquet), read as documents, with errors that say what is wrong."""

import json
import os
from collections.abc import Iterator
from pathlib import Path

from toolkit.data.documents import Document, paragraphs
from toolkit.errors import DataError

LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
TXT_CHUNK_CHARS = 4000  # a long .txt becomes paragraph-aligned chunks of about this size


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


def looks_like_path(source: str) -> bool:
    return (Path(source).expanduser().exists() or source.lower().endswith(LOCAL_SUFFIXES)
            or source.startswith(("/", "./", "../", "~")))


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


_READERS = dict(zip(LOCAL_SUFFIXES, (_read_txt, _read_jsonl, _read_parquet)))


def local_documents(path: Path) -> list[Document]:
    path = checked_file(path)
    reader = _READERS.get(path.suffix.lower())
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
