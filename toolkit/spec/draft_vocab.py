"""A draft's head over the most frequent tokens only (`spec.head_vocab`; FR-Spec, Zhao et al. 2025).

A draft's output head is the largest single read of its step (SmolLM2-135M's 49152 x 576; Qwen2.5-Coder-0.5B's
151936 x 896, 136M of its 494M weights), yet text is mostly made of a few thousand tokens: on held-out pydoc and
stdlib code, the 8192 most frequent tokens of the calibration splits cover ~97% of the tokens and 16384 cover
~99.5% (docs/speculative.md). A draft whose head scores only those reads a fraction of the head's
bytes; where the target's next token lies outside the set, the draft cannot propose it and the round stops
there. Correctness is untouched: the target verifies every token, greedy output stays the target's, and under
sampling the draft's distribution q is simply zero outside the set (rejection sampling stays exact for any q).

Frequencies come from text that is always on the machine and held apart from every evaluation prompt: the
calibration splits of pydoc (English prose) and stdlib-code, each weighted as one half, so neither kind of text
crowds out the other. Ties break by token id, so the set is a function of the tokenizer alone.
"""

from __future__ import annotations

from collections import Counter

import torch

from toolkit.data import CALIBRATION, load_text
from toolkit.errors import InputError

# enough text for stable counts of the top tens of thousands of tokens, and tokenized in well under a second
_SOURCES = ("pydoc", "stdlib-code")
_CHARS_PER_SOURCE = 1_500_000
_ROWS_MULTIPLE = 64


def _texts(source: str) -> list[str]:

    out, total = [], 0
    for text in load_text(source, split=CALIBRATION)["text"]:
        out.append(text)
        total += len(text)
        if total >= _CHARS_PER_SOURCE:
            break
    return out


def token_ranking(tokenizer) -> list[int]:
    """Token ids by decreasing frequency share over the sources (each source's counts divided by its total, then
    summed), ties by id; special tokens first, whatever their counts, since a draft must be able to stop."""
    return list(_ranking(tokenizer))


_RANKINGS: dict[tuple, tuple[int, ...]] = {}  # per tokenizer fingerprint: a draft built twice ranks once


def _fingerprint(tokenizer) -> tuple:
    vocab = tokenizer.get_vocab()
    return getattr(tokenizer, "name_or_path", ""), len(vocab), hash(frozenset(vocab.items()))


def _ranking(tokenizer) -> tuple[int, ...]:
    key = _fingerprint(tokenizer)
    if key not in _RANKINGS:
        share: Counter = Counter()
        for source in _SOURCES:
            counts = Counter(i for ids in tokenizer(_texts(source)).input_ids for i in ids)
            total = sum(counts.values()) or 1
            for token, n in counts.items():
                share[token] += n / total
        special = sorted(set(tokenizer.all_special_ids))
        ranked = sorted((t for t in share if t not in special), key=lambda t: (-share[t], t))
        _RANKINGS[key] = tuple(special + ranked)
    return _RANKINGS[key]


def frequent_tokens(tokenizer, n: int, vocab_size: int) -> torch.Tensor | None:
    """The ids (sorted ascending, int64) of the `n` most frequent tokens (`token_ranking`) below `vocab_size` (the
    head's rows), or None when `n` covers the whole head. Fewer than `n` when the sources hold fewer distinct
    tokens (a token never seen in them is not worth a row), and a multiple of 64."""
    if tokenizer is None:
        raise InputError("spec.head_vocab needs the target's tokenizer to rank tokens by frequency",
                         "pass the tokenizer, or set spec.head_vocab=null")
    if n < 1:
        raise InputError(f"spec.head_vocab must be a positive number of tokens or null, got {n}",
                         "use e.g. spec.head_vocab=8192, or null for the whole vocabulary")
    if n >= vocab_size:
        return None
    ids = [t for t in _ranking(tokenizer) if t < vocab_size][:n]
    # whole tiles of the low-bit kernels' layouts (16 output channels), so the head keeps its fast kernel
    ids = ids[:max(len(ids) // _ROWS_MULTIPLE * _ROWS_MULTIPLE, min(len(ids), _ROWS_MULTIPLE))]
    return torch.tensor(sorted(ids), dtype=torch.long)


def _append(rows: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if rows is None else torch.cat([rows, new])


class SubsetHead(torch.nn.Module):
    """A draft's output head over a token subset: `main` (the draft's quantized head over the frequent tokens'
    rows, `ids`) plus, as the generation goes, the rows of every other token its context holds (`include`), from
    the float head's weight (`source`) in fp32. Text repeats its own rare tokens (names, identifiers): on SmolLM2's
    greedy continuations of open prompts, the 8192 most frequent tokens cover 96.4% of the emitted tokens, and with
    the prompt's own tokens added 99.2%. Logits are over `vocab_ids`, in that order."""

    def __init__(self, main: torch.nn.Module, ids: torch.Tensor, source: torch.Tensor,
                 source_bias: torch.Tensor | None = None):
        super().__init__()
        self.main, self.ids, self.source, self.source_bias = main, ids, source, source_bias
        self.out_features = len(ids)
        self.reset()

    def reset(self) -> None:
        """Drop the context's tokens (a new generation)."""
        self.member = torch.zeros(self.source.shape[0], dtype=torch.bool)
        self.member[self.ids] = True
        self.extra_ids = self.ids[:0]
        self.extra_weight: torch.Tensor | None = None
        self.extra_bias: torch.Tensor | None = None
        self.vocab_ids = self.ids

    def include(self, tokens: list[int]) -> None:
        """Score these tokens too from now on (those outside the subset; ids past the head's rows are no tokens)."""
        rows = self.source.shape[0]
        fresh = sorted({t for t in tokens if 0 <= t < rows and not self.member[t]})
        if not fresh:
            return
        new = torch.tensor(fresh, dtype=torch.long)
        self.member[new] = True
        self.extra_ids = torch.cat([self.extra_ids, new])
        # only the new rows are gathered: the earlier ones are already in place
        self.extra_weight = _append(self.extra_weight, self.source[new].float())
        if self.source_bias is not None:
            self.extra_bias = _append(self.extra_bias, self.source_bias[new].float())
        self.vocab_ids = torch.cat([self.ids, self.extra_ids])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.main(x)
        if self.extra_weight is None:
            return logits
        extra = torch.nn.functional.linear(x.to(torch.float32), self.extra_weight, self.extra_bias)
        return torch.cat([logits, extra.to(logits.dtype)], dim=-1)

    def extra_repr(self) -> str:
        return f"{len(self.ids)} frequent tokens + {len(self.extra_ids)} from the context"
