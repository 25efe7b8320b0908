"""The sources that ship inside every CPython, so they need no fetch: pydoc's topic help and the stdlib's code."""

import os
import sysconfig
import tokenize
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from toolkit.data.documents import Document

# Test suites, third-party packages and generated tables are not the stdlib code a model should complete;
# pydoc_data is excluded because it is the `pydoc` prose source.
_STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib-dynload",
                     "encodings", "pydoc_data"}


@cache
def pydoc_documents() -> list[Document]:
    """Python's topic help, a document per topic (the text behind help('TOPIC'))."""
    from pydoc_data.topics import topics

    return [Document(key, topics[key], key) for key in sorted(topics)]


def _stdlib_files(root: Path) -> Iterator[Path]:
    for folder, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _STDLIB_SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(files):
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                yield Path(folder, name)


@cache
def stdlib_documents() -> list[Document]:
    """The running Python's standard library .py files, a document per file keyed by its relative path."""
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
