"""Logits for every position of a batch of windows, either in one forward pass or fed through a KV cache.

A KV cache changes a model's outputs only where tokens are read back from it: one forward pass over a window
attends to freshly computed keys and values and never reads the cache. To measure a quantized cache, windows are
therefore fed `chunk` tokens at a time through `make_kv_cache`, so every chunk after the first attends to keys and
values that went through the cache (quantized, for a quantized kind), as they do in decoding."""

import torch

from toolkit.kv import make_kv_cache


@torch.inference_mode()
def window_logits(model, ids: torch.Tensor, kv_cfg=None, chunk: int | None = None) -> torch.Tensor:
    """[B, T] token ids -> [B, T, vocab] logits (in the model's activation dtype)."""
    device = next(model.parameters()).device
    ids = ids.to(device)
    if not chunk or chunk >= ids.shape[1]:
        return model(input_ids=ids, use_cache=False).logits
    batch, length = ids.shape
    cache = make_kv_cache(model, length, kv_cfg)
    out = []
    for start in range(0, length, chunk):
        piece = ids[:, start:start + chunk]
        positions = torch.arange(start, start + piece.shape[1], device=device).expand(batch, -1)
        out.append(model(input_ids=piece, position_ids=positions, cache=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)
