"""Named prompt sets for benchmarks, cut from evaluation splits so that prompts never repeat calibration text.

Each prompt is sized under the caller's tokenizer to come as close to `prompt_tokens` tokens as a clean cut
allows, and never over: the passage ends at a sentence end (prose) or line end (code) if one falls within a
few tokens of the budget, else at a word end, else after a word or punctuation mark (long code tokens).
Cutting the original text, rather than decoding a token slice, keeps its exact spelling and whitespace
under any tokenizer.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from toolkit.data.documents import paragraphs
from toolkit.data.local_files import (
    checked_file,
    jsonl_records,
    looks_like_path,
    read_text_file,
)
from toolkit.data.sources import load_text
from toolkit.data.splits import EVALUATION
from toolkit.errors import DataError, InputError


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    kind: str  # the prompt set it came from (a PROMPT_SETS name), or "file"


PROMPT_SETS: dict[str, str] = {
    "open": "continue a passage of English prose (pydoc, evaluation split)",
    "grounded": "summarise, list the names in, or rewrite a given passage (pydoc, evaluation split)",
    "code": "complete a stretch of standard-library code (stdlib-code, evaluation split)",
    "story": "continue a passage of Persuasion (austen, evaluation split; needs `specquant data fetch austen`)",
    "docs": "continue a passage of the Python documentation (pydocs, evaluation split; "
            "needs `specquant data fetch pydocs`)",
}

_GROUNDED_TASKS = (  # used in turn, so any n mixes the three evenly
    "Summarise the passage below in two sentences.\n\nPassage:\n{passage}\n\nSummary:",
    "List the names (of people, functions, modules, classes) mentioned in the passage below, one per line."
    "\n\nPassage:\n{passage}\n\nNames:",
    "Rewrite the passage below in plain English.\n\nPassage:\n{passage}\n\nRewrite:",
)

# Far more characters than `budget` tokens can span, so a window always holds a full-size passage
# (runs of indentation can be single tokens of many characters).
_MAX_CHARS_PER_TOKEN = 16
_WORD_END = re.compile(r"\S(?=\s|$)")
# Failing a word end near the budget: after a word-character run or a punctuation mark, but never inside
# a contraction ("don’t"), so code can end at "foo(" or "x." and prose never at "don’".
_FINE_END = re.compile(r"\w(?![\w'’])|[^\w\s'’]")
_SENTENCE_END = re.compile(r"[.!?][\"')\]’”]*(?=\s|$)")
_LINE_END = re.compile(r"\S(?=[ \t]*(?:\n|$))")
_SENTENCE_START = re.compile(r"(?:\A|[.!?][\"')\]’”]*\s+|\n[ \t]*\n)(?=[A-Z\"“‘])")
_UNDERLINE = re.compile(r"[*=\-~^]{3,}[ \t]*$", re.M)
_TOP_LEVEL_DEF = re.compile(r"^(?:@|(?:async\s+)?def\s|class\s)", re.M)


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of the text itself, without the special tokens (BOS) a tokenizer may add around it.
    Duck-typed: HF tokenizers, `tokenizers.Tokenizer`, or anything with encode(text) or __call__."""
    if hasattr(tokenizer, "encode"):
        try:
            ids = tokenizer.encode(text, add_special_tokens=False)
        except TypeError:  # a minimal tokenizer without that keyword
            ids = tokenizer.encode(text)
    else:
        ids = tokenizer(text)["input_ids"]
    return len(getattr(ids, "ids", ids))  # tokenizers.Tokenizer returns an Encoding


def _ends(pattern: re.Pattern, text: str) -> list[int]:
    return [m.end() for m in pattern.finditer(text)]


def _prose_starts(text: str) -> list[int]:
    """Where sentences begin, outside indented code blocks and headings."""
    starts = []
    for m in _SENTENCE_START.finditer(text):
        start = m.end()
        line_start = text.rfind("\n", 0, start) + 1
        indented = start > line_start and text[line_start:start].isspace()
        heading = _UNDERLINE.match(text, text.find("\n", start) + 1) is not None
        if not indented and not heading:
            starts.append(start)
    return starts


def _code_starts(text: str) -> list[int]:
    return [m.start() for m in _TOP_LEVEL_DEF.finditer(text)]


@dataclass(frozen=True)
class _Style:
    starts: Callable[[str], list[int]]  # where a passage may begin
    nice_end: re.Pattern  # where it had best end, when that costs only a few tokens


_PROSE = _Style(_prose_starts, _SENTENCE_END)
_CODE = _Style(_code_starts, _LINE_END)


def _tolerance(budget: int) -> int:
    """Tokens a prompt may fall short: to end at a nicer cut, or because a long unbreakable run (a URL, a
    regex) sits at the budget. Small, as equal prompt sizes make benchmark runs comparable."""
    return max(1, budget // 64)


def _best_cut(count: Callable[[str], int], text: str, cuts: list[int], budget: int) -> tuple[int, int] | None:
    """(cut, tokens) for the longest text[:cut] within budget tokens, or None. Binary search, as token counts
    grow with the cut; only O(log n) encodings of budget-sized text."""
    best, lo, hi = None, 0, len(cuts) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        tokens = count(text[:cuts[mid]])
        if tokens <= budget:
            best, lo = (cuts[mid], tokens), mid + 1
        else:
            hi = mid - 1
    return best


def _passage(count: Callable[[str], int], window: str, style: _Style, budget: int) -> str | None:
    """The passage at the start of `window` nearest `budget` tokens, ending at the nicest cut that costs at
    most a few tokens; None when no cut comes that close (the document ends first, or an unbreakable run)."""
    tolerance = _tolerance(budget)
    if count(window) < budget - tolerance:
        return None  # one encoding rules out windows cut short by their document's end
    levels = [_ends(pattern, window) for pattern in (style.nice_end, _WORD_END, _FINE_END)]  # nicest first
    finest = _best_cut(count, window, levels[-1], budget)
    if finest is None or finest[1] < budget - tolerance:
        return None
    for cuts in levels:  # the finest level always qualifies, so this returns
        best = _best_cut(count, window, [c for c in cuts if c <= finest[0]], budget)
        if best is not None and best[1] >= finest[1] - tolerance:
            return window[:best[0]]


def _prompt_tokens(tokenizer, template: str, passage: str) -> int:
    return count_tokens(tokenizer, template.format(passage=passage))


def _cut_prompts(name: str, texts: Sequence[str], style: _Style, templates: Sequence[str], tokenizer,
                 budget: int, n: int, seed: int) -> list[Prompt]:
    """n prompts from random passage starts (a seeded shuffle of every start in every text)."""
    frame = max(count_tokens(tokenizer, t.format(passage="")) for t in templates)
    if frame >= budget:
        raise InputError(f"{budget} tokens is too short for {name} prompts: the instruction alone takes {frame}",
                         fix=f"ask for more than {frame} prompt tokens")
    candidates = [(i, start) for i, text in enumerate(texts) for start in style.starts(text)]
    random.Random(seed).shuffle(candidates)
    prompts: list[Prompt] = []
    for i, start in candidates:
        template = templates[len(prompts) % len(templates)]
        window = texts[i][start:start + budget * _MAX_CHARS_PER_TOKEN]
        passage = _passage(partial(_prompt_tokens, tokenizer, template), window, style, budget)
        if passage is not None:
            prompts.append(Prompt(f"{name}-{seed}-{len(prompts)}", template.format(passage=passage), name))
            if len(prompts) == n:
                return prompts
    raise DataError(f"only {len(prompts)} {name} prompts of {budget} tokens fit in its evaluation text",
                    fix="ask for fewer prompts or fewer prompt tokens, or use a set of longer passages: code (whole "
                        "stdlib modules, past 8,000 tokens), docs, story")


def _named(source: str, style: _Style, templates: Sequence[str] = ("{passage}",)):
    def build(name: str, tokenizer, budget: int, n: int, seed: int) -> list[Prompt]:
        texts = list(load_text(source, split=EVALUATION)["text"])
        return _cut_prompts(name, texts, style, templates, tokenizer, budget, n, seed)

    return build


_BUILDERS = {
    "open": _named("pydoc", _PROSE),
    "grounded": _named("pydoc", _PROSE, _GROUNDED_TASKS),
    "code": _named("stdlib-code", _CODE),
    "story": _named("austen", _PROSE),
    "docs": _named("pydocs", _PROSE),
}


def _file_prompts(path: Path, n: int) -> list[Prompt]:
    """A user's prompts, used verbatim and in file order: .txt blocks between blank lines, or .jsonl
    objects with a "prompt" (else "text") field."""
    path = checked_file(path)
    if path.suffix.lower() == ".txt":
        texts = paragraphs(read_text_file(path))
    elif path.suffix.lower() == ".jsonl":
        texts = [_jsonl_prompt(path, lineno, record) for lineno, record in jsonl_records(path)]
    else:
        raise DataError(f"{path}: prompts must be a .txt or .jsonl file", fix="use a .txt or .jsonl file")
    if not texts:
        raise DataError(f"{path} holds no prompts",
                        fix="write one prompt per blank-line separated block (.txt) or per line (.jsonl)")
    return [Prompt(f"{path.stem}-{i}", text, "file") for i, text in enumerate(texts[:n])]


def _jsonl_prompt(path: Path, lineno: int, record: dict) -> str:
    text = record.get("prompt", record.get("text"))
    if not isinstance(text, str) or not text.strip():
        raise DataError(f"{path} line {lineno} has no string field \"prompt\" or \"text\"",
                        fix='give each line a "prompt" field, e.g. {"prompt": "..."}')
    return text


def _check_positive(**values: int) -> None:
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InputError(f"{key} must be a positive whole number, got {value!r}", fix=f"pass {key} >= 1")


def build_prompts(name: str | os.PathLike, tokenizer, prompt_tokens: int, n: int, seed: int = 0) -> list[Prompt]:
    """n prompts of the named set (see PROMPT_SETS), each as close to prompt_tokens tokens of `tokenizer` as
    a clean cut allows and never over; the same arguments always give the same prompts, and a larger n
    extends a smaller one. A .txt/.jsonl path gives the file's first n prompts verbatim."""
    _check_positive(prompt_tokens=prompt_tokens, n=n)
    source = os.fspath(name)
    if source in _BUILDERS:
        return _BUILDERS[source](source, tokenizer, prompt_tokens, n, seed)
    if looks_like_path(source):
        return _file_prompts(Path(source), n)
    raise DataError(f"unknown prompt set {source!r}",
                    fix=f"use one of: {', '.join(PROMPT_SETS)}; or a .txt/.jsonl file of prompts")
