"""Log-probabilities of continuations given contexts, batched: the scoring behind cloze and multiple choice.

Each context is fed once, however many continuations it has (multiple choice has four): a batch of contexts is
left-padded and prefilled into a KV cache (`make_kv_cache`, so a quantized kind is measured as decoding reads it),
the cache's rows are repeated once per continuation (`reorder_cache`), and the continuations are fed right-padded
behind them, their positions continuing from each context's length. The context's last logits predict each
continuation's first token; the continuation's own logits predict the rest. On pydoc's multiple-choice items
(~90-token passages, four ~16-token endings) that is ~156 tokens per item instead of ~427."""

import torch

from toolkit.engine.generate import positions_from_mask
from toolkit.kv import KVSpec, make_kv_cache


def encode_pairs(tokenizer, pairs: list[tuple[str, str]], max_context: int) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) texts -> token ids, tokenised apart (the continuation's leading space stays its
    own), the context cut from the left to `max_context` tokens including BOS."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    out = []
    for context, continuation in pairs:
        ctx = tokenizer(context, add_special_tokens=False).input_ids[-(max_context - len(bos)):]
        out.append((bos + ctx, tokenizer(continuation, add_special_tokens=False).input_ids))
    return out


@torch.inference_mode()
def score_continuations(model, encoded: list[tuple[list[int], list[int]]], pad_id: int, batch_size: int = 16,
                        kv: KVSpec | None = None, progress=None) -> list[dict]:
    """For each (context ids, continuation ids): `logprob` (sum over the continuation's tokens) and `greedy`
    (every continuation token is the model's argmax given what precedes it). `batch_size` counts continuations;
    a context's continuations always share a batch."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (context, _) in enumerate(encoded):
        groups.setdefault(tuple(context), []).append(i)
    # similar lengths share a batch, so little of it is padding
    contexts = sorted(groups, key=lambda c: (len(c), max(len(encoded[i][1]) for i in groups[c])))
    out: list[dict] = [{} for _ in encoded]
    for batch in _pack(contexts, {c: len(groups[c]) for c in contexts}, batch_size):
        index = [i for c in batch for i in groups[c]]
        logits = _continuation_logits(model, [list(c) for c in batch], [len(groups[c]) for c in batch],
                                      [encoded[i][1] for i in index], pad_id, kv)
        for row, i in enumerate(index):
            target = torch.tensor(encoded[i][1])
            pred = logits[row, :len(target)].float()
            logprob = pred.log_softmax(-1).gather(-1, target[:, None]).sum().item()
            out[i] = {"logprob": logprob, "greedy": bool((pred.argmax(-1) == target).all())}
        if progress:
            progress(len(index))
    return out


def _pack(contexts: list, rows: dict, limit: int):
    """Consecutive contexts in batches of at most `limit` rows (a context with more rows than that alone)."""
    batch, held = [], 0
    for context in contexts:
        if batch and held + rows[context] > limit:
            yield batch
            batch, held = [], 0
        batch.append(context)
        held += rows[context]
    if batch:
        yield batch


def _continuation_logits(model, contexts: list[list[int]], repeats: list[int], continuations: list[list[int]],
                         pad_id: int, kv) -> torch.Tensor:
    """Logits [rows, longest continuation, V]: row r position j predicts token j of continuation r, whose context
    is contexts[k] for the k-th group of `repeats[k]` rows."""
    width = max(map(len, contexts))
    ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for i, c in enumerate(contexts):
        ids[i, width - len(c):] = torch.tensor(c)
        mask[i, width - len(c):] = 1
    longest = max(map(len, continuations))
    cache = make_kv_cache(model, width + longest, kv)
    first = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask), cache=cache,
                  use_cache=True, logits_to_keep=1).logits[:, -1]
    owner = torch.repeat_interleave(torch.arange(len(contexts)), torch.tensor(repeats))
    if longest == 1:  # single-token continuations: the context's logits are all there is to score
        return first[owner, None]
    cache.reorder_cache(owner)
    tail = torch.full((len(owner), longest), pad_id, dtype=torch.long)
    tail_mask = torch.zeros_like(tail)
    for r, t in enumerate(continuations):
        tail[r, :len(t)] = torch.tensor(t)
        tail_mask[r, :len(t)] = 1
    lengths = mask.sum(-1)[owner]
    positions = lengths[:, None] + torch.arange(longest)
    rest = model(input_ids=tail, attention_mask=torch.cat([mask[owner], tail_mask], dim=-1), position_ids=positions,
                 cache=cache, use_cache=True).logits
    # the context's last logits predict each continuation's first token; continuation position j predicts j+1
    return torch.cat([first[owner, None].to(rest.dtype), rest[:, :-1]], dim=1)
