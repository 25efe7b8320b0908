"""The speculative decoding loop: prefill the target, then rounds of

    draft proposes up to k tokens per sequence -> the target scores them all in ONE forward pass (k+1 positions)
    -> verify (spec/verify.py) keeps a prefix per sequence and adds the target's own next token
    -> target and draft caches roll back what was not kept -> repeat

until every sequence has `new_tokens` tokens or stopped. Nothing past `new_tokens` or a stop token is ever emitted.

Batches verify together; each sequence keeps its own number of tokens per round (see spec/ragged.py for how one
shared cache holds rows of different lengths). Draft length is fixed (`k`) or adaptive: one longer after a round
where every draft token was kept, one shorter after a rejection, within [k_min, k_max].
"""

import itertools
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from toolkit.engine.generate import (
    Detokenizer,
    GenerationResult,
    TokenCallback,
    encode_prompts,
    finish_sequences,
    stop_token_ids,
    take_token,
    validate_request,
)
from toolkit.engine.precision import bf16_prefill
from toolkit.engine.sampling import SamplingParams, sample
from toolkit.errors import InputError
from toolkit.kv import kv_spec, make_kv_cache
from toolkit.kv.config import KVSpec
from toolkit.model_state import peek
from toolkit.spec.ragged import RaggedBatch
from toolkit.spec.verify import verify
from toolkit.timing import GenerationTiming


@dataclass(frozen=True)
class DraftLength:
    k: int = 4
    adaptive: bool = False
    k_min: int = 1
    k_max: int = 8

    def __post_init__(self):
        if self.k < 1 or (self.adaptive and not 1 <= self.k_min <= self.k <= self.k_max):
            raise InputError(f"draft length must satisfy 1 <= k_min <= k <= k_max, got k={self.k}, "
                             f"k_min={self.k_min}, k_max={self.k_max}", "set spec.k (and spec.k_min/k_max)")

    def next(self, k: int, full: bool) -> int:
        if not self.adaptive:
            return self.k
        return min(k + 1, self.k_max) if full else max(k - 1, self.k_min)


@dataclass
class SpecStats:
    """Per verify round and sequence: how many drafted tokens were proposed and kept."""

    rounds: int = 0  # target verify passes
    proposed: int = 0
    accepted: int = 0
    row_rounds: int = 0  # (sequence, round) pairs with at least one drafted token
    histogram: Counter = field(default_factory=Counter)  # kept drafted tokens per (sequence, round) -> count
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    total_s: float = 0.0
    new_tokens: int = 0  # over all sequences

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        if proposed:
            self.row_rounds += 1
            self.histogram[accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        """Share of drafted tokens the target kept."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def mean_accepted(self) -> float:
        """Drafted tokens kept per verify round (per sequence, rounds with a draft): each round emits this + 1."""
        return self.accepted / self.row_rounds if self.row_rounds else float("nan")

    def summary(self) -> dict:
        return {"rounds": self.rounds, "proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": self.acceptance_rate, "mean_accepted": self.mean_accepted,
                "accepted_histogram": {int(k): v for k, v in sorted(self.histogram.items())},
                "draft_s": self.draft_s, "verify_s": self.verify_s, "prefill_s": self.prefill_s,
                "total_s": self.total_s,
                "tokens_per_s": self.new_tokens / self.total_s if self.total_s else float("nan")}


@dataclass
class SpecResult(GenerationResult):
    stats: SpecStats | None = None  # always set by speculative_generate (a default only because the base has one)


def capacity(width: int, new_tokens: int, k_max: int, batch: int) -> int:
    """Cache slots a generation can need. One sequence keeps a prefix each round, so it never holds more than
    prompt + new tokens + one round's unkept tail. In a batch each round may leave up to k+1 slots per row (the
    longest row's advance), and there are at most new_tokens rounds."""
    if batch == 1:
        return width + new_tokens + k_max + 2
    return width + new_tokens * (k_max + 1) + 2


def speculative_generate(model, tokenizer, prompts, new_tokens: int, draft, length: DraftLength = DraftLength(),
                         sampling: SamplingParams | None = None, stop_strings: Sequence[str] = (),
                         stop_tokens: set[int] | None = None, on_token: TokenCallback | None = None,
                         kv: KVSpec | None = None, generator: torch.Generator | None = None) -> SpecResult:
    """Generate like `engine.generate.generate` (same arguments, same outputs: greedy output is token-identical
    to it, sampled output has the same distribution), with `draft` proposing tokens the target verifies."""

    sampling = sampling or SamplingParams()
    encoded = encode_prompts(tokenizer, prompts)
    validate_request(model, [len(ids) for ids in encoded], new_tokens)
    stop_tokens = stop_token_ids(model, tokenizer) if stop_tokens is None else set(stop_tokens)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(stop_tokens), 0)
    batch = len(encoded)
    width = max(len(ids) for ids in encoded)
    k_max = length.k_max if length.adaptive else length.k
    # a verify pass feeds k + 1 tokens and may roll them all back: quantized caches keep shadows that deep
    kv = kv_spec(kv).with_rollback(k_max + 1, f"speculative decoding with k={k_max} (the target's cache)")
    if hasattr(draft, "kv"):  # a model draft's own cache (with_rollback passes fp through)
        draft.kv = draft.kv.with_rollback(k_max + 1, f"speculative decoding with k={k_max} (the draft's cache)")
    if generator is None:
        generator = sampling.generator(next(model.parameters()).device)
    if hasattr(draft, "generator") and draft.generator is None:
        draft.generator = generator  # one stream of random numbers for the whole run: seeded runs repeat
    slots = capacity(width, new_tokens, k_max, batch)
    target = RaggedBatch(model, make_kv_cache(model, slots, kv), batch, pad_id,
                         peek(model).decode_forward)
    draft.reset(target, slots)
    detok = [Detokenizer(tokenizer, stop_strings) for _ in range(batch)] if (on_token or stop_strings) else None
    stats = SpecStats()
    generated: list[list[int]] = [[] for _ in range(batch)]
    finish = [""] * batch
    marks: list[tuple[float, int]] = []  # (time, tokens emitted by the round): one entry per target pass

    def emit(row: int, tokens: list[int]) -> int:
        """Append `tokens` to row `row` up to a stop or the budget; returns how many were taken."""
        taken = 0
        for token in tokens:
            if not take_token(row, token, generated, finish, stop_tokens, detok, on_token):
                break
            taken += 1
            if len(generated[row]) >= new_tokens:
                finish[row] = finish[row] or "length"
        return taken

    start = time.perf_counter()
    # the prompt, as the engine's prefill runs it: logits of the last position only, bf16 products where prepared so
    target.mark()
    with bf16_prefill():
        logits = target.feed([ids for ids in encoded], logits=1)[:, -1]
    target.keep([len(ids) for ids in encoded])
    # from here on every pass is a verify pass: its rows read a quantized cache as one-token steps would, so that
    # greedy output stays the target's own (KV cache `read_splits`); the prompt read as at its start, as the engine's
    target.cache.stepwise_reads = True
    first = sample(logits, sampling, generator).tolist()
    pending = first  # per row: the latest token, emitted but not yet run through the target
    for row, token in enumerate(first):
        emit(row, [token])
    stats.prefill_s = time.perf_counter() - start
    marks.append((time.perf_counter(), batch))
    contexts = [list(ids) + [tok] for ids, tok in zip(encoded, first)]
    k = length.k
    while not all(finish):
        active = [not f for f in finish]
        budget = [new_tokens - len(g) for g in generated]
        # never draft past the budget: a round emits at most k + 1 tokens
        round_k = min(k, max(b - 1 for b, a in zip(budget, active) if a))
        t0 = time.perf_counter()
        proposals, draft_probs = draft.propose(contexts, round_k, active)
        proposals = [p[:max(budget[i] - 1, 0)] if active[i] else [] for i, p in enumerate(proposals)]
        t1 = time.perf_counter()
        target.mark()
        rows = [[pending[i]] + proposals[i] if active[i] else [pad_id] for i in range(batch)]
        logits = target.feed(rows)
        verdicts = []
        for i in range(batch):
            if not active[i]:
                verdicts.append(None)
                continue
            n = len(proposals[i])
            q = draft_probs[i][:n] if draft_probs[i] is not None else None
            verdicts.append(verify(logits[i, -(n + 1):], proposals[i], q, sampling, generator))
        target.keep([v.accepted + 1 if v else 0 for v in verdicts])
        draft.accept([v.accepted if v else 0 for v in verdicts])
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.rounds += 1
        emitted = 0
        full = True
        for i, v in enumerate(verdicts):
            if v is None:
                continue
            stats.record(len(proposals[i]), v.accepted)
            full = full and v.accepted == len(proposals[i])
            tokens = v.tokens(proposals[i])
            emitted += emit(i, tokens)
            contexts[i].extend(tokens)
            pending[i] = v.next_token
        marks.append((t2, emitted))
        k = length.next(k, full and round_k == k)
        if batch > 1:
            pending = [p if not f else pad_id for p, f in zip(pending, finish)]

    stats.total_s = time.perf_counter() - start
    stats.new_tokens = sum(len(g) for g in generated)
    sequences = finish_sequences(tokenizer, encoded, generated, finish, detok, on_token)
    return SpecResult(sequences=sequences, timing=_timing(start, marks, width, batch),
                      kv_bytes=getattr(target.cache, "nbytes", 0), stats=stats)


def _timing(start: float, marks: list[tuple[float, int]], width: int, batch: int) -> GenerationTiming:
    """The engine's timing shape: TTFT, then one inter-token latency per token. A round that emits n tokens at
    once counts as n latencies of a round's time / n each (the mean a reader of the stream sees)."""
    ttft = marks[0][0] - start
    itl = []
    for (t_prev, _), (t, n) in itertools.pairwise(marks):
        per_row = max(1, round(n / batch)) if batch > 1 else max(n, 1)
        itl.extend([(t - t_prev) / per_row] * per_row)
    return GenerationTiming(width, batch, ttft, itl)
