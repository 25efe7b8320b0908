"""Perplexity, KL(reference || candidate) and top-1 agreement on the same windows, batch by batch (a window's
logits are [window, vocab] floats, ~100 MB for SmolLM2, so they are reduced to sums as soon as they exist)."""

import torch

from toolkit.evaluation.forward import window_logits
from toolkit.evaluation.metrics import Accumulator
from toolkit.kv import KVSpec


@torch.inference_mode()
def score_windows(model, windows: torch.Tensor, reference=None, kv: KVSpec | None = None, chunk: int | None = None,
                  batch_size: int = 2, progress=None) -> dict:
    """Figures over `windows` [n, T]: `ppl` of `model` (run with the `kv` cache, fed `chunk` tokens at a time),
    and against `reference` (one plain forward pass, no cache read) `ref_ppl`, `kl` (nats per scored token) and
    `top1_agreement`. reference=None: the model is its own reference (KL 0, agreement 1, one pass)."""
    acc = Accumulator()
    for start in range(0, len(windows), batch_size):
        batch = windows[start:start + batch_size]
        targets = batch[:, 1:]
        logits = window_logits(model, batch, kv, chunk)[:, :-1]
        ref_logits = logits if reference is None else window_logits(reference, batch)[:, :-1]
        acc.add(logits, ref_logits, targets.to(logits.device))
        del logits, ref_logits
        if progress:
            progress(len(batch))
    return acc.figures()
