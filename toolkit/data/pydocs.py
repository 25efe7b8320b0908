"""The pydocs source: the Python 3.11 documentation, a document per section, read from the GNU info manual that
Debian ships in python3.11-doc."""

import gzip
import re
from pathlib import Path

from toolkit.data.debian import DebianPackage
from toolkit.data.documents import Document

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


def _parse(root: Path) -> list[Document]:
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


PACKAGE = DebianPackage("python3.11-doc", _PYTHON_INFO, _parse)
