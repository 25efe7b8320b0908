"""Calibration and evaluation splits that share no text, and the `datasets` objects that hold them.

A document's key decides its split, so no document straddles splits. Sources repeat themselves (pydoc topics
quote each other's sections, stdlib files copy code), so documents that repeat a larger one are dropped and
documents that share text are kept in one split: evaluation prompts never quote calibration text.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

from toolkit.data.documents import Document, paragraphs

if TYPE_CHECKING:  # `datasets` takes a second to import; only the functions that build datasets pay for it
    import datasets

CALIBRATION, EVALUATION, OTHER = "calibration", "evaluation", "other"
ALL = "all"  # the one split of a file the user names: they chose it for the job, so it is used whole
EVALUATION_SHARE = 0.2

_SHARED_BLOCK_CHARS = 100  # shorter blocks ("New in version 3.5.", "pass") recur everywhere and leak nothing
_CONTAINED_SHARE = 0.9


def hash_split(key: str) -> str:
    """Assign a key to a split by a stable hash (not hash(), which is salted per process).
    Each key is placed on its own, so adding documents never moves existing ones between splits."""
    draw = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    return EVALUATION if draw < EVALUATION_SHARE else CALIBRATION


def to_splits(docs: list[Document], splits: list[str],
              names: tuple[str, ...] = (CALIBRATION, EVALUATION)) -> datasets.DatasetDict:
    """Group documents by their split. The `names` splits always exist, even empty, so callers can rely on them."""
    import datasets

    columns: dict[str, dict[str, list[str]]] = {name: {"title": [], "text": []} for name in names}
    for doc, split in zip(docs, splits):
        column = columns.setdefault(split, {"title": [], "text": []})
        column["title"].append(doc.title)
        column["text"].append(doc.text)
    features = datasets.Features({"title": datasets.Value("string"), "text": datasets.Value("string")})
    return datasets.DatasetDict({name: datasets.Dataset.from_dict(column, features=features)
                                 for name, column in columns.items()})


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


def drop_contained(docs: list[Document]) -> list[Document]:
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
