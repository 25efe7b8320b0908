"""Windowed full-precision caches (`kv.window=W`, `kv.sink=S`): the first S tokens (attention sinks) and the most
recent tokens, in constant memory however long the generation runs. docs/kv-cache.md "Windowed caches".

Policy. The cache holds at most S + W + slack tokens. When a call's rows would not fit, the oldest tokens past the
sinks are dropped at once, leaving the last W; the call's rows go behind them. So every token attends to the sinks
and to at least the W tokens before it (at most W + slack): llama.cpp's context shift, with a shift of `slack`
tokens instead of half the context. Dropping in blocks keeps the layout contiguous (attention, the native stack
included, reads slots 0..length as it always does) and moves the kept tokens once per `slack` steps instead of on
every step. A call may add at most `slack` rows (`call_rows`): longer prompts are fed in pieces of that size.

Positions. Queries and new keys keep their absolute positions (RoPE makes a score depend only on the distance
between query and key), so the kept tokens stay where they were. Only the sinks would drift ever further from the
queries, to distances the model never saw in training; as StreamingLLM does, they are placed just before the oldest
kept token instead: each time D more tokens are dropped, the sinks' keys are turned by D more positions
(`turn_keys`), from their originals each time so no rounding accumulates.
"""

from dataclasses import dataclass

import torch

SLACK = 256  # tokens dropped at once: the kept window moves once per SLACK steps (~W/256 rows copied a step)


@dataclass(frozen=True)
class Window:
    size: int  # W: the recent tokens every query sees at least
    sink: int  # S: the first tokens kept for good

    @property
    def slack(self) -> int:
        return max(1, min(SLACK, self.size))

    @property
    def capacity(self) -> int:
        return self.sink + self.size + self.slack


def turn_keys(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys [..., D] (fp32) rotated as RoPE rotated them at position p, turned to position p + delta: the pairs
    (i, i + half) of the first 2 * half channels (half = len(inv_freq)) by delta * inv_freq[i]. Composing RoPE
    rotations adds their angles, so this equals rotating the un-rotated key at p + delta."""
    half = inv_freq.numel()
    angle = delta * inv_freq.double().cpu()
    cos, sin = angle.cos().float().to(keys.device), angle.sin().float().to(keys.device)
    a, b = keys[..., :half], keys[..., half:2 * half]
    out = keys.clone()
    out[..., :half] = a * cos - b * sin
    out[..., half:2 * half] = b * cos + a * sin
    return out


def slide(layer, rows: int) -> None:
    """Make room in a windowed ContiguousKVLayer for `rows` new tokens (see the module docstring): drop the
    oldest tokens past the sinks down to the last W when the rows would not fit, and turn the sinks' keys."""
    window = layer.window
    if rows > window.slack:
        raise RuntimeError(f"{rows} rows in one call to a windowed cache that takes {window.slack}: feed them in "
                           "pieces (`call_rows`)")
    if not layer.is_initialized or layer.length + rows <= layer.max_length:
        return
    sink, keep = window.sink, window.size
    drop = layer.length - sink - keep
    kb, vb = layer.key_buffer, layer.value_buffer
    kb[:, :, sink:sink + keep] = kb[:, :, layer.length - keep:layer.length].clone()
    vb[:, :, sink:sink + keep] = vb[:, :, layer.length - keep:layer.length].clone()
    layer.length = sink + keep
    layer.dropped += drop
    if sink and layer.inv_freq is not None:
        if layer.sink_keys is None:  # still as written: rotated at positions 0..S-1
            layer.sink_keys = kb[:, :, :sink].float().clone()
        kb[:, :, :sink] = turn_keys(layer.sink_keys, layer.dropped, layer.inv_freq).to(kb.dtype)
