"""Logits for every position of a batch of windows, either in one forward pass or fed through a KV cache.

A KV cache changes a model's outputs only where tokens are read back from it: one forward pass over a window
attends to freshly computed keys and values and never reads the cache. To measure a quantized cache, windows are
therefore fed `chunk` tokens at a time through `make_kv_cache`, so every chunk after the first attends to keys and
values that went through the cache (quantized, for a quantized kind), as they do in decoding. A windowed cache
(kv.window) always reads through the cache, at most its `call_rows` a call."""

import torch

from toolkit.engine.precision import runs_int8_activations
from toolkit.kv import KVSpec, kv_spec, make_kv_cache

NATIVE_CHUNK = 1024
"""Tokens per call when a window runs on the native stack (under its prompt bound, `W4A8_MAX_ROWS`)."""


@torch.inference_mode()
def window_logits(model, ids: torch.Tensor, kv: KVSpec | None = None, chunk: int | None = None) -> torch.Tensor:
    """[B, T] token ids -> [B, T, vocab] logits (in the model's activation dtype)."""
    device = next(model.parameters()).device
    ids = ids.to(device)
    if runs_int8_activations(model):
        return _native_window_logits(model, ids, kv, chunk)
    if (not chunk or chunk >= ids.shape[1]) and not kv_spec(kv).window:
        return model(input_ids=ids, use_cache=False).logits
    batch, length = ids.shape
    cache = make_kv_cache(model, length, kv)
    chunk = min(chunk or length, cache.call_rows or length)  # a windowed cache takes at most its slack a call
    out = []
    for start in range(0, length, chunk):
        piece = ids[:, start:start + chunk]
        positions = torch.arange(start, start + piece.shape[1], device=device).expand(batch, -1)
        cache.make_room(piece.shape[1])
        out.append(model(input_ids=piece, position_ids=positions, cache=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)


def _native_window_logits(model, ids: torch.Tensor, kv, chunk: int | None = None) -> torch.Tensor:
    """engine.native_dot=int8: the int8 activations exist only on the native stack, which runs one sequence at a
    time; each window goes through it alone, `chunk` (at most `NATIVE_CHUNK`) tokens a call, so the figures are the
    arithmetic generation uses -- a quantized cache's codes read in integers included (docs/kv-cache.md)."""
    out = []
    for row in ids:
        cache = make_kv_cache(model, row.shape[0], kv)
        step = min(chunk or NATIVE_CHUNK, NATIVE_CHUNK, cache.call_rows or NATIVE_CHUNK)
        pieces = []
        for start in range(0, row.shape[0], step):
            piece = row[None, start:start + step]
            positions = torch.arange(start, start + piece.shape[1], device=ids.device)[None]
            cache.make_room(piece.shape[1])
            pieces.append(model(input_ids=piece, position_ids=positions, cache=cache, use_cache=True).logits)
        out.append(torch.cat(pieces, dim=1))
    return torch.cat(out)
