"""Windowed caches (`kv.window=W`, `kv.sink=S`): the first S tokens (attention sinks) and the most recent tokens, in
constant memory however long the generation runs. docs/kv-cache.md "Windowed caches".

Policy. The cache holds at most S + W + slack tokens. When a call's rows would not fit, the oldest tokens past the
sinks are dropped at once, leaving the last W; the call's rows go behind them. So every token attends to the sinks
and to at least the W tokens before it (at most W + slack): llama.cpp's context shift, with a shift of `slack`
tokens instead of half the context. Dropping in blocks keeps the layout contiguous (attention, the native stack
included, reads slots 0..length as it always does) and moves the kept tokens once per `slack` steps instead of on
every step. A call may add at most `slack` rows (`call_rows`): longer prompts are fed in pieces of that size.

A quantized cache (KIVI, toolkit/kv/quantized_cache.py) drops whole key groups, two at a time (`align`: the INT8
staging ring is indexed by position modulo two groups), so every code, scale and ring slot stays valid where it is
moved, and the state stays the one a cache of the new length holds. Its head is the sinks rounded up to whole
groups, kept in full precision (its `sink` originals), so that the head can be turned too.

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
    align: int = 1  # tokens are dropped in multiples of this (a quantized cache: two key groups)

    @property
    def slack(self) -> int:
        """The most rows one call may add; also about how many tokens go at each drop."""
        return max(1, min(SLACK, self.size))

    @property
    def capacity(self) -> int:
        return self.sink + self.size + self.slack + self.align - 1

    def to_drop(self, length: int, rows: int) -> int:
        """Tokens past the sinks to drop before `rows` more join `length`: none while they fit, else the most (a
        multiple of `align`) leaving at least the last W."""
        if rows > self.slack:
            raise RuntimeError(f"{rows} rows in one call to a windowed cache that takes {self.slack}: feed them in "
                               "pieces (`call_rows`)")
        if length + rows <= self.capacity:
            return 0
        return (length - self.sink - self.size) // self.align * self.align


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


def _shift(buffer: torch.Tensor, start: int, end: int, by: int) -> None:
    """Move slots [start + by, end) of buffer [B, H, slots, ...] down to start."""
    buffer[:, :, start:end - by] = buffer[:, :, start + by:end].clone()


def _turn_sinks(layer, sink_buffer: torch.Tensor) -> None:
    """Set the layer's sink keys (the first slots of `sink_buffer`) to their originals turned by what was dropped."""
    sink = layer.window.sink
    if not sink or layer.inv_freq is None:
        return
    if layer.sink_keys is None:  # still as written: rotated at positions 0..S-1
        layer.sink_keys = sink_buffer[:, :, :sink].float().clone()
    sink_buffer[:, :, :sink] = turn_keys(layer.sink_keys, layer.dropped, layer.inv_freq).to(sink_buffer.dtype)


def slide(layer, rows: int) -> None:
    """Make room in a windowed ContiguousKVLayer for `rows` new tokens (see the module docstring): drop the
    oldest tokens past the sinks down to the last W when the rows would not fit, and turn the sinks' keys."""
    drop = layer.window.to_drop(layer.length, rows)
    if not layer.is_initialized or not drop:
        return
    for buffer in (layer.key_buffer, layer.value_buffer):
        _shift(buffer, layer.window.sink, layer.length, drop)
    layer.length -= drop
    layer.dropped += drop
    _turn_sinks(layer, layer.key_buffer)


def slide_quantized(layer, rows: int) -> None:
    """`slide` for a windowed QuantizedKVLayer: whole key groups past the head leave (`Window.align`); grouped keys
    and their scales, quantized values and their scales move down, the INT8 ring keeps its slots (the drop is a
    multiple of its size), and the full-precision window and shadows, kept relative to the quantized values' end,
    stay as they are."""
    drop = layer.window.to_drop(layer.length, rows)
    if not layer.is_initialized or not drop:
        return
    head, G = layer.window.sink, layer.cfg.group_size
    if head + drop > layer.quantized:
        raise RuntimeError(f"a windowed cache would drop tokens {head}..{head + drop} before they are in groups "
                           f"({layer.quantized}): kv.window is below kv.residual + kv.group_size")
    for codes in layer.k_codes:
        _shift(codes, head, layer.quantized, drop)
    for codes in layer.v_codes:
        _shift(codes, head, layer.v_quantized, drop)
    for scale in (layer.k_scale, layer.k_min):
        _shift(scale, head // G, layer.quantized // G, drop // G)
    for scale in (layer.v_scale, layer.v_min):
        _shift(scale, head, layer.v_quantized, drop)
    layer.length -= drop
    layer.quantized -= drop
    layer.v_quantized -= drop
    layer.ring_floor = max(0, layer.ring_floor - drop)
    layer.dropped += drop
    if head:
        _turn_sinks(layer, layer.k_sink)
