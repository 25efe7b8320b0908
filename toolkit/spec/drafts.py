"""Drafts: what proposes tokens for the target to verify. One small interface, three kinds.

    reset(target, capacity)              start a generation of the sequences of `target` (the target's
                                         RaggedBatch: its batch size and pad id; a self-draft may read its cache)
    propose(contexts, k, active) -> (tokens, probs)
                                         per row: up to k drafted tokens after the row's context (prompt + every
                                         token emitted so far), and their draft distributions q [n, vocab] (None
                                         when the draft is deterministic: q is one-hot on the drafted token)
    accept(accepted)                     per row: how many of the proposed tokens the target kept; a draft with
                                         state rolls it back to match

`ModelDraft` runs any causal LM with the target's tokenizer; `SelfDraft` (spec/self_draft.py) builds one from the
target's own weights; `LookupDraft` matches n-grams of the context (prompt lookup decoding), no model.
"""

import torch

from toolkit.engine.sampling import SamplingParams, argmax, probabilities
from toolkit.errors import InputError
from toolkit.kv import KVSpec, kv_spec, make_kv_cache
from toolkit.kv.contiguous import ContiguousKVCache
from toolkit.kv.quantized_cache import QuantizedKVCache
from toolkit.model_state import peek
from toolkit.spec.ragged import RaggedBatch


class LookupDraft:
    """Prompt lookup decoding (Saxena 2023): find the latest earlier occurrence of the context's last n tokens
    (n from `ngram_max` down to `ngram_min`) and propose the tokens that followed it. Free to run, deterministic,
    and strong wherever the output copies its input (grounded answers, code edits).

    `scale_by_match`: propose k * n / ngram_max tokens (rounded, at least 1) after an n-token match instead of k.
    A one-token match is weak evidence that the text repeats, and every proposed token is one more row in the
    target's verify pass, which on a CPU costs a few percent of a step each; proposing few tokens on weak matches
    and many on strong ones keeps most of the accepted tokens at fewer rows (docs/speculative.md).

    `agree_tokens` > 0 (the config default, 4) also asks the context a second question: does the tail occur once
    more before its latest occurrence, and did the same `agree_tokens` tokens follow it there? If they did, the text
    is repeating a passage for the second time, and the draft proposes the full k. If they did not, the
    continuation is a guess among several, and the draft proposes at most `doubt_k` tokens. A tail seen only once
    gets half of what `scale_by_match` would give it. So k is the most a round proposes, spent only where the
    context vouches for it. The rule reads the context alone (no state across rounds), so the server's continuous
    batches use it as is. Why these numbers: replaying the rule on recorded greedy outputs under the measured cost
    of a verify pass (docs/notes/2026-12-speculative-measurements.md)."""

    deterministic = True

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1, scale_by_match: bool = False, agree_tokens: int = 0,
                 doubt_k: int = 2):
        if not 1 <= ngram_min <= ngram_max:
            raise InputError(f"lookup n-gram sizes must satisfy 1 <= ngram_min <= ngram_max, got "
                             f"{ngram_min}..{ngram_max}", "set spec.ngram_min / spec.ngram_max, e.g. 1 and 3")
        if agree_tokens < 0 or doubt_k < 1:
            raise InputError(f"lookup needs agree_tokens >= 0 and doubt_k >= 1, got {agree_tokens} and {doubt_k}",
                             "set spec.agree_tokens (0 turns the agreement rule off) and spec.doubt_k, e.g. 4 and 2")
        self.ngram_max, self.ngram_min, self.scale_by_match = ngram_max, ngram_min, scale_by_match
        self.agree_tokens, self.doubt_k = agree_tokens, doubt_k

    def reset(self, target: RaggedBatch, capacity: int) -> None:
        pass

    def match(self, context: list[int]) -> tuple[int, int] | None:
        """(where the continuation starts, n) for the latest earlier occurrence of the longest matching tail, or
        None when no tail of ngram_min..ngram_max tokens occurs earlier."""
        for n in range(min(self.ngram_max, len(context) - 1), self.ngram_min - 1, -1):
            tail = context[-n:]
            # latest match first: recent text predicts the continuation best
            for start in range(len(context) - n - 1, -1, -1):
                if context[start:start + n] == tail:
                    return start + n, n
        return None

    def agreement(self, context: list[int], start: int, n: int) -> int:
        """+1 when the n-token tail's previous occurrence (before the latest, which ends at `start`) was followed by
        the same `agree_tokens` tokens, -1 when by different ones, 0 when there is no previous occurrence."""
        tail = context[-n:]
        for earlier in range(start - n - 1, -1, -1):
            if context[earlier:earlier + n] == tail:
                latest = context[start:start + self.agree_tokens]
                before = context[earlier + n:earlier + n + self.agree_tokens]
                m = min(len(latest), len(before))
                return 1 if latest[:m] == before[:m] else -1
        return 0

    def draft_length(self, k: int, n: int, agreement: int | None = None) -> int:
        """Tokens to propose after an n-token match, for a round of at most k (`agreement`: see `agreement`; None
        when the rule is off)."""
        if agreement == 1:
            return k
        # k * n / ngram_max (scale_by_match) or k, halved while the rule is on (a tail seen once), rounded half up
        numerator = k * (n if self.scale_by_match else self.ngram_max)
        denominator = self.ngram_max * (1 if agreement is None else 2)
        length = max(1, (numerator + denominator // 2) // denominator)
        return min(length, self.doubt_k) if agreement == -1 else length

    def describe(self, details: str = "") -> str:
        """"lookup (n-grams 1..3, length by match<details>)": how generate, bench and serve name this draft."""
        scaled = ", length by match" if self.scale_by_match else ""
        agree = f", by agreement of {self.agree_tokens}" if self.agree_tokens else ""
        return f"lookup (n-grams {self.ngram_min}..{self.ngram_max}{scaled}{agree}{details})"

    def lookup(self, context: list[int], k: int) -> list[int]:
        found = self.match(context)
        if found is None:
            return []
        start, n = found
        agreement = self.agreement(context, start, n) if self.agree_tokens else None
        return context[start:start + self.draft_length(k, n, agreement)]

    def propose(self, contexts, k, active=None):
        tokens = [self.lookup(ctx, k) if (active is None or active[i]) and k > 0 else []
                  for i, ctx in enumerate(contexts)]
        return tokens, [None] * len(contexts)

    def accept(self, accepted) -> None:
        pass


def vocab_mismatch(target_tokenizer, draft_tokenizer) -> str | None:
    """Why two tokenizers cannot share token ids, or None when they can."""
    if target_tokenizer is None or draft_tokenizer is None or target_tokenizer is draft_tokenizer:
        return None
    a, b = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()))[:3]
        return f"vocabularies differ ({len(a)} vs {len(b)} tokens; e.g. {differ})"
    for attr in ("eos_token_id", "bos_token_id"):
        if getattr(target_tokenizer, attr) != getattr(draft_tokenizer, attr):
            return f"{attr} differs ({getattr(target_tokenizer, attr)} vs {getattr(draft_tokenizer, attr)})"
    return None


def _reading_bounds(cache, length: int) -> tuple[int, int]:
    """Below which slot a cache of `length` tokens reads keys from groups and values quantized (a quantized cache's
    `quantized` and `v_quantized`, functions of the length alone); a full-precision cache reads every slot as
    written (`length`)."""
    cfg = getattr(cache.layers[0], "cfg", None)
    return (length, length) if cfg is None else cfg.reading_bounds(length)


class ModelDraft:
    """Any causal LM that shares the target's tokenizer drafts k tokens, one forward each, over its own KV cache
    (made by `toolkit.kv.make_kv_cache`, so a quantized cache works too) and rolls it back on rejection.

    `min_confidence` > 0 stops a row's draft at the first token the draft gives less than that probability: a
    cheap way to spend draft steps only where they are likely accepted.

    `share_kv` (a self-draft's, `spec.share_kv`; QuantSpec's shared cache): every token the target has verified is
    in the draft's cache with the target's own keys and values, copied from the target's cache each round, so the
    draft never runs the prompt and computes keys and values only for the tokens it drafts (and the round's first,
    the target's correction). Only a draft whose layer i is the target's layer i at another precision can read
    them (the self-draft); one sequence, the draft's cache full precision, the target's full precision or quantized
    (`kv=int8/int4`: read dequantized, as the target's attention reads it); else the draft keeps its own. With the
    target's cache full precision and the draft's too, the draft runs in the target's cache itself ("in place"): it
    writes its drafted tokens' keys and values in the slots past the target's length and drops them when its round
    is drafted (the target's verify pass writes its own there), so nothing is copied at all -- the copy cost eight
    small tensor operations a layer each round (docs/notes/2026-12-runtime-kernels-native-decoder.md, "The draft step's own costs")."""

    deterministic = False

    def __init__(self, model, sampling: SamplingParams | None = None, target_tokenizer=None,
                 draft_tokenizer=None, target_vocab: int | None = None, kv: KVSpec | None = None,
                 min_confidence: float = 0.0, generator: torch.Generator | None = None, share_kv: bool = False):
        problem = vocab_mismatch(target_tokenizer, draft_tokenizer)
        if problem:
            raise InputError(f"the draft model's tokenizer does not match the target's: {problem}",
                             "use a draft from the same model family (same tokenizer), e.g. a smaller size or a "
                             "quantized checkpoint of the target, or spec=lookup / spec=self")
        self.model, self.sampling, self.kv = model, sampling or SamplingParams(), kv_spec(kv)
        self.target_vocab, self.min_confidence, self.generator = target_vocab, min_confidence, generator
        self.state: RaggedBatch | None = None
        self.share_kv = share_kv
        self.target: RaggedBatch | None = None  # the target's batch whose cache this draft reads (`share_kv`)
        # a head over a token subset (`spec.head_vocab`, spec/draft_vocab.py): its logits' columns are its vocab_ids
        head = model.get_output_embeddings()
        self.subset = head if hasattr(head, "vocab_ids") else None

    def reset(self, target: RaggedBatch, capacity: int) -> None:

        batch = target.batch
        # in place: a full-precision target cache is the draft's own cache too (see the class docstring)
        self.in_place = (self.share_kv and batch == 1 and not self.kv.quantized
                         and type(target.cache) is ContiguousKVCache
                         and self.model.config.num_hidden_layers <= len(target.cache.layers))
        cache = target.cache if self.in_place else make_kv_cache(self.model, capacity, self.kv)
        self.state = RaggedBatch(self.model, cache, batch, target.pad_id,
                                 peek(self.model).decode_forward)
        self.fed = [0] * batch  # per row: context tokens already in the draft's cache
        self.synced = 0  # with a shared cache: slots holding the target's keys and values
        # share_kv: read the target's cache where both caches can (see the class docstring)
        shares = (self.share_kv and batch == 1 and type(cache) is ContiguousKVCache
                  and type(target.cache) in (ContiguousKVCache, QuantizedKVCache)
                  and len(cache.layers) <= len(target.cache.layers))
        self.target = target if shares else None
        self._round = None
        if self.subset is not None:
            self.subset.reset()
        self.scored = [0] * batch  # per row: context tokens the subset head has been offered (`include`)

    def _sync(self) -> None:
        """Make the draft's cache the target's for every verified token: drop the draft's own keys and values past
        what came from the target, copy the target's slots after it."""
        state, source = self.state, self.target.cache
        # a quantized cache reads a token back differently once it leaves the full-precision window (its values
        # quantized and its key staged: `v_quantized` grew) and again once its key joins a group (`quantized` grew);
        # both only grow with the length, so what changed since the last sync starts at the old bound that moved
        start, end = self.synced, source.length
        (k_was, v_was), (k_now, v_now) = _reading_bounds(source, start), _reading_bounds(source, end)
        if v_now > v_was:
            start = min(start, v_was)
        if k_now > k_was:
            start = min(start, k_was)
        state.cache.crop(start)
        for mine, theirs in zip(state.cache.layers, source.layers):
            keys, values = theirs.attention_view(start)  # a quantized cache's dequantized, as the target reads it
            if not mine.is_initialized:
                mine.lazy_initialization(keys, values)
            mine.key_buffer[:, :, start:end].copy_(keys[:, :, :end - start])
            mine.value_buffer[:, :, start:end].copy_(values[:, :, :end - start])
            mine.advance(end - start)
        state.reset_to(end)
        self.fed[0] = self.synced = end

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary (checkpoints pad embedding tables to different sizes; the
        padding is no token, so it gets -inf); a subset head keeps its own columns (`propose` maps them to tokens)."""
        n = self.target_vocab
        if n is None or logits.shape[-1] == n or self.subset is not None:
            return logits
        if logits.shape[-1] > n:
            return logits[..., :n]
        return torch.nn.functional.pad(logits, (0, n - logits.shape[-1]), value=float("-inf"))

    def propose(self, contexts, k, active=None):
        batch = len(contexts)
        active = active or [True] * batch
        state = self.state
        if self.in_place and active[0]:  # the target's cache holds every verified token: draft on from its end
            self.fed[0] = self.target.cache.length
            state.reset_to(self.fed[0])
        elif self.target is not None and active[0]:
            self._sync()
        state.mark()
        if self.subset is not None:  # the context's own tokens join the subset head's (a name, once seen, recurs)
            for i, ctx in enumerate(contexts):
                self.subset.include(ctx[self.scored[i]:])
                self.scored[i] = len(ctx)
        # catch up: feed what the draft has not seen (the last round's correction, and the last draft token when
        # all were accepted); a finished row feeds a pad that it never keeps
        first = [ctx[self.fed[i]:] if active[i] else [state.pad_id] for i, ctx in enumerate(contexts)]
        catch_up = [len(f) if active[i] else 0 for i, f in enumerate(first)]
        tokens = [[] for _ in range(batch)]
        probs = [[] for _ in range(batch)]
        drafting = [a and k > 0 for a in active]
        steps = 0
        greedy = self.sampling.greedy  # a greedy round never reads q (the draft is then one-hot)
        if any(drafting):
            logits = self._fit_vocab(state.feed(first, logits=1)[:, -1].float())
            while True:
                q = None if greedy else probabilities(logits, self.sampling)
                chosen = argmax(logits) if greedy else torch.multinomial(q, 1, generator=self.generator).squeeze(-1)
                if self.subset is not None:  # subset columns -> token ids; q over the target's vocabulary
                    ids = self.subset.vocab_ids
                    chosen = ids[chosen]
                    if not greedy:
                        vocab = self.target_vocab or self.subset.source.shape[0]
                        q = q.new_zeros(q.shape[0], vocab).index_copy_(1, ids, q)
                confidence = logits.softmax(-1).amax(-1) if self.min_confidence > 0 else None
                steps += 1
                for i in range(batch):
                    if not drafting[i]:
                        continue
                    if confidence is not None and tokens[i] and float(confidence[i]) < self.min_confidence:
                        drafting[i] = False  # the first token is always drafted: a round costs a target pass anyway
                        continue
                    tokens[i].append(int(chosen[i]))
                    if q is not None:
                        probs[i].append(q[i])
                    if len(tokens[i]) == k:
                        drafting[i] = False
                if not any(drafting):
                    break
                logits = self._fit_vocab(state.feed([[int(t)] for t in chosen], logits=1)[:, -1].float())
        self._round = (contexts, catch_up, steps, active)
        if self.in_place:  # the drafted tokens' keys and values sit past the target's length: drop them
            state.keep([0])
        q_out = [torch.stack(p) if p and not greedy else None for p in probs]
        return tokens, q_out

    def accept(self, accepted) -> None:
        if self.in_place:  # nothing of the draft's own was kept (`propose`): the next round reads the target's
            return
        contexts, catch_up, steps, active = self._round
        if steps == 0:  # nothing drafted: nothing fed; the next round catches up on the whole tail
            self.state.keep([0] * len(contexts))
            return
        kept = []
        for i, ctx in enumerate(contexts):
            if not active[i]:
                kept.append(0)
                continue
            in_cache = min(accepted[i], steps - 1)  # draft token j is in the cache only if a later step fed it
            kept.append(catch_up[i] + in_cache)
            self.fed[i] = len(ctx) + in_cache
        self.state.keep(kept)
