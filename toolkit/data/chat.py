"""The chat domain, and the domains quality is measured on (docs/evaluation.md "Domains").

A chat model is mostly used through its chat template: role markers and special tokens that no plain text
contains. `chat` is conversations made from the offline sources -- a question about a pydoc topic answered with
the topic's text, a passage of Austen continued, a stdlib module shown in a code block -- rendered with the
model's own chat template (plain "User:/Assistant:" turns where it has none). Each conversation comes from one
document of its source's split, so chat's calibration and evaluation splits are as disjoint as the sources'.

`DOMAINS`: what `data=domains` evaluates and the `mix` calibration set draws from, by what a user writes: prose,
technical docs, code, chat.
"""

from __future__ import annotations

from toolkit.data.documents import paragraphs
from toolkit.data.sources import fetch, is_cached, load_text

CHAT = "chat"
# domain -> its source; `mix` calibrates on each in turn, window i from domain i % 4 (calibration_batches)
DOMAINS = {"prose": "austen", "docs": "pydoc", "code": "stdlib-code", "chat": CHAT}
MIX = "mix"
ANSWER_CHARS = 1500  # an answer's length: a few hundred tokens, like a chat reply


def fetch_domains() -> None:
    """Fetch, once, the sources the domains need that do not ship with Python (Austen, from the Debian registry),
    as a model is fetched on first use; offline, fetch's error says what to do."""
    for name in ("austen",):
        if not is_cached(name):
            fetch(name)


def conversations(split: str) -> list[list[dict]]:
    """Conversations [{"role", "content"}, ...] from the documents of `split` of each source, interleaved, as many
    of each kind (the fewest any source gives, picked evenly from the others: stdlib's 500 files would otherwise
    make chat mostly code)."""
    kinds = [_docs_turns(split), _prose_turns(split), _code_turns(split)]
    n = min(map(len, kinds))
    return [kind[i * len(kind) // n] for i in range(n) for kind in kinds]


def _turns(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def _docs_turns(split: str) -> list[list[dict]]:
    data = load_text("pydoc", split)
    return [_turns(f"What does Python's documentation say about {title}?", text[:ANSWER_CHARS].strip())
            for title, text in zip(data["title"], data["text"])]


def _prose_turns(split: str) -> list[list[dict]]:
    data = load_text("austen", split)
    out = []
    for title, text in zip(data["title"], data["text"]):
        blocks = paragraphs(text)
        if len(blocks) >= 2:
            out.append(_turns(f"Continue this passage from {title}:\n\n{blocks[0]}",
                              "\n\n".join(blocks[1:4])[:ANSWER_CHARS]))
    return out


def _code_turns(split: str) -> list[list[dict]]:
    data = load_text("stdlib-code", split)
    return [_turns(f"Show me how the standard library's {title} begins.",
                   f"```python\n{text[:ANSWER_CHARS].rstrip()}\n```") for title, text in zip(data["title"], data["text"])]


def render(tokenizer, convs: list[list[dict]]) -> list[str]:
    """Each conversation as the model sees it: its chat template's text (special tokens written out, to be
    tokenized without adding more), or plain turns where the tokenizer has no template."""
    if getattr(tokenizer, "chat_template", None):
        return [tokenizer.apply_chat_template(c, tokenize=False) for c in convs]
    return ["\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in c) for c in convs]


def domain_texts(name: str, split: str, tokenizer) -> list[str]:
    """The texts of dataset or domain `name` (a DOMAINS key, `chat`, or anything load_text takes) for `split`."""
    name = DOMAINS.get(name, name)
    if name in (CHAT, "austen"):
        fetch_domains()
    if name == CHAT:
        return render(tokenizer, conversations(split))
    return list(load_text(name, split)["text"])
