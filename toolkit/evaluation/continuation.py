"""Log-probabilities of continuations given contexts, batched: the scoring behind cloze and multiple choice.

Each row is BOS (when the tokenizer has one) + the context's last tokens + the continuation, left-padded so every
continuation ends in the last column; then only the last positions' logits are computed (`logits_to_keep`), which
skips most of the [tokens, vocab] output matmul. Rows are sorted by length so a batch holds similar lengths.
With a KV cache (`kv_cfg`), a batch is fed in two pieces, context then continuation, so the continuation attends
to keys and values read back from the cache, as in decoding."""

import torch

from toolkit.engine.generate import positions_from_mask
from toolkit.kv import make_kv_cache


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
                        kv_cfg=None, cached: bool = False, progress=None) -> list[dict]:
    """For each (context ids, continuation ids): `logprob` (sum over the continuation's tokens) and `greedy`
    (every continuation token is the model's argmax given what precedes it)."""
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]) + len(encoded[i][1]))
    out: list[dict] = [{} for _ in encoded]
    for start in range(0, len(order), batch_size):
        index = order[start:start + batch_size]
        rows = [encoded[i] for i in index]
        logits = _predicting_logits(model, rows, pad_id, kv_cfg, cached)
        for row, i in enumerate(index):
            target = torch.tensor(encoded[i][1])
            pred = logits[row, logits.shape[1] - len(target):].float()
            logprob = pred.log_softmax(-1).gather(-1, target[:, None]).sum().item()
            out[i] = {"logprob": logprob, "greedy": bool((pred.argmax(-1) == target).all())}
        if progress:
            progress(len(index))
    return out


def _predicting_logits(model, rows, pad_id, kv_cfg, cached):
    """Logits [B, keep, V] whose position j predicts the j-th of the last `keep` tokens of each row."""
    width = max(len(c) + len(t) for c, t in rows)
    keep = max(len(t) for _, t in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (c, t) in enumerate(rows):
        seq = c + t
        ids[i, width - len(seq):] = torch.tensor(seq)
        mask[i, width - len(seq):] = 1
    positions = positions_from_mask(mask)
    # the logits at columns width-keep-1 .. width-2 predict the last `keep` tokens
    if not cached:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                       logits_to_keep=keep + 1).logits
        return logits[:, :-1]
    cut = width - keep - 1  # the context before the cut goes into the cache first; the rest reads it back
    cache = make_kv_cache(model, width, kv_cfg)
    if cut:
        model(input_ids=ids[:, :cut], attention_mask=mask[:, :cut], position_ids=positions[:, :cut], cache=cache,
              use_cache=True, logits_to_keep=1)
    logits = model(input_ids=ids[:, cut:], attention_mask=mask, position_ids=positions[:, cut:], cache=cache,
                   use_cache=True).logits
    return logits[:, :-1]
