"""Cloze and multiple-choice items built deterministically from held-out text, built once and cached.

Both tasks cut the evaluation split's text at word boundaries, so any text (prose, documentation, code comments)
yields items and the same text always yields the same items:

- **cloze** (LAMBADA-style): a passage (up to `CONTEXT_CHARS` of the text before a word) whose last word is to be
  predicted. Only words of 4+ letters that already occur in the passage are targets (LAMBADA keeps passages whose
  last word a reader can recover from the context; reoccurrence is the mechanical stand-in), one per `CLOZE_GAP`
  characters so items do not pile up on one sentence.
- **mc** (HellaSwag-style): a passage and four endings of `ENDING_WORDS` words: the text's true continuation and
  three continuations taken from other items (other documents first), chosen by a generator seeded from the
  item's own text, so every ending has the same number of words and only its content gives it away.

Items are cached under `$SPECQUANT_HOME/eval-items/<task>-<content hash>.json`: the hash covers the builder's
version, its settings and the text, so editing any of them builds anew; the file stores a sha256 of its items,
checked on load (a damaged file is rebuilt), and is written atomically."""

import hashlib
import json
import random
import re
import sys

from toolkit.errors import DataError
from toolkit.fileio import write_json_atomic
from toolkit.paths import home

BUILDER_VERSION = 1
CONTEXT_CHARS = 400
CLOZE_GAP = 40
MC_GAP = 90
ENDING_WORDS = 10
MIN_CONTEXT_CHARS = 200
CHOICES = 4

_WORD = re.compile(r"(?<![\w.])([A-Za-z]{4,})\b")
_TOKEN = re.compile(r"\S+")


def _passage(text: str, end: int) -> str:
    """The text before `end`, at most CONTEXT_CHARS, starting at a word boundary."""
    start = max(0, end - CONTEXT_CHARS)
    if start:
        space = text.find(" ", start, end)
        start = space + 1 if space != -1 else start
    return text[start:end]


def _spaced_items(texts: list[str], pattern: re.Pattern, gap: int, make) -> list[dict]:
    """The items `make(doc, text, match)` builds at `pattern`'s matches in each text, each match at least
    MIN_CONTEXT_CHARS into its text and `gap` characters after the last one kept there (a match `make` turns down,
    returning None, keeps nothing)."""
    items = []
    for doc, text in enumerate(texts):
        last = -gap
        for match in pattern.finditer(text):
            at = match.start()
            if at < MIN_CONTEXT_CHARS or at - last < gap:
                continue
            item = make(doc, text, match)
            if item is not None:
                items.append(item)
                last = at
    return items


def _cloze_item(doc: int, text: str, match: re.Match) -> dict | None:
    raw = _passage(text, match.start())
    word = match.group(1)
    if not re.search(rf"\b{word}\b", raw):
        return None
    # the whitespace before the word goes with the target: that is how the tokenizer sees a word mid-text
    # (" word"), and context and target are tokenised apart
    context = raw.rstrip()
    return {"doc": doc, "context": context, "target": raw[len(context):] + word}


def build_cloze(texts: list[str]) -> list[dict]:
    return _spaced_items(texts, _WORD, CLOZE_GAP, _cloze_item)


def _mc_stem(doc: int, text: str, match: re.Match) -> dict | None:
    at = match.start()
    words = _TOKEN.findall(text[at:at + 40 * ENDING_WORDS])[:ENDING_WORDS]
    if len(words) < ENDING_WORDS:
        return None
    return {"doc": doc, "context": _passage(text, at).rstrip(), "ending": " " + " ".join(words)}


def build_mc(texts: list[str]) -> list[dict]:
    stems = _spaced_items(texts, _TOKEN, MC_GAP, _mc_stem)
    items = []
    for i, stem in enumerate(stems):
        rng = random.Random(hashlib.sha256(stem["context"].encode()).digest())
        others = [j for j in range(len(stems)) if stems[j]["doc"] != stem["doc"]] or \
                 [j for j in range(len(stems)) if j != i]
        picks = []
        for j in rng.sample(others, min(len(others), 4 * CHOICES)):
            if stems[j]["ending"] != stem["ending"] and stems[j]["ending"] not in picks:
                picks.append(stems[j]["ending"])
            if len(picks) == CHOICES - 1:
                break
        if len(picks) < CHOICES - 1:
            continue
        label = rng.randrange(CHOICES)
        endings = picks[:label] + [stem["ending"]] + picks[label:]
        items.append({"doc": stem["doc"], "context": stem["context"], "endings": endings, "label": label})
    return items


BUILDERS = {"cloze": build_cloze, "mc": build_mc}


def content_hash(task: str, texts: list[str]) -> str:
    digest = hashlib.sha256(json.dumps({"task": task, "version": BUILDER_VERSION, "context": CONTEXT_CHARS,
                                        "cloze_gap": CLOZE_GAP, "mc_gap": MC_GAP, "ending_words": ENDING_WORDS,
                                        "min_context": MIN_CONTEXT_CHARS, "choices": CHOICES}).encode())
    for text in texts:
        digest.update(hashlib.sha256(text.encode()).digest())
    return digest.hexdigest()


def _items_checksum(items: list[dict]) -> str:
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()


def items_dir():
    return home() / "eval-items"


def load_items(task: str, texts: list[str], data: str = "text") -> tuple[list[dict], str]:
    """The task's items for `texts` and their content hash: from the cache when present and intact, else built
    and cached."""
    if task not in BUILDERS:
        raise DataError(f"no item builder for task {task!r}", f"use one of {', '.join(BUILDERS)}")
    key = content_hash(task, texts)
    path = items_dir() / f"{task}-{key[:16]}.json"
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
            if stored.get("hash") == key and stored.get("sha256") == _items_checksum(stored["items"]):
                return stored["items"], key
        except (OSError, ValueError, KeyError):
            pass
        print(f"eval items {path} are damaged: rebuilding them", file=sys.stderr)
    items = BUILDERS[task](texts)
    if not items:
        raise DataError(f"{data} yields no {task} items", "use a dataset with more text (e.g. data=austen)")
    write_json_atomic(path, {"task": task, "data": data, "hash": key, "count": len(items),
                             "sha256": _items_checksum(items), "items": items})
    return items, key


def spread(items: list, limit: int | None) -> list:
    """At most `limit` items, evenly spaced over the whole list (not the first `limit`, which would all come from
    the first documents)."""
    if not limit or limit >= len(items):
        return list(items)
    step = len(items) / limit
    return [items[int(i * step)] for i in range(limit)]
