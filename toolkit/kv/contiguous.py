"""A preallocated, croppable full-precision KV cache that transformers' attention layers write into.

transformers' DynamicCache grows by `torch.cat` on every step (a copy of the whole cache per layer per token) and its
StaticCache attends over the full preallocated length behind a mask. This cache preallocates once and hands attention
views of exactly the filled prefix, so a decode step neither copies the past nor reads unused slots.

Interface shared with the quantized and paged caches to come: `update` (append + read, as transformers calls it),
`crop(length)`, `length`, `nbytes`. The buffers may hold a narrower dtype than the activations (`kv.dtype`,
docs/kv-cache.md "The float cache in 2 bytes"): written rounded, read widened. Sliding-window layers (Gemma 3)
keep their full history here; the sliding mask built by transformers limits what they attend to, so results are
the same at the cost of memory. With `kv.window` the cache keeps only its first and last tokens instead
(toolkit/kv/window.py): callers make room before each call (`make_room`) and feed at most `call_rows` rows a call.
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from toolkit.kv.rope import rope_frequencies
from toolkit.kv.window import Window, slide


class CountedKVLayer(CacheLayerMixin):
    """A croppable full-attention cache layer that holds `length` tokens of at most `max_length` (the contiguous and
    the quantized caches' layers), and the sizes transformers asks such a layer for."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    # kv.window (toolkit/kv/window.py): the window's shape and the model's RoPE frequencies (set by a windowed
    # cache), the tokens dropped so far and the sinks' keys as first written (set by `_slide`)
    window: Window | None = None
    inv_freq: torch.Tensor | None = None
    dropped = 0
    sink_keys: torch.Tensor | None = None
    _slide = staticmethod(slide)  # how this kind of layer drops tokens

    def make_room(self, rows: int) -> None:
        """A windowed layer: drop its oldest tokens past the sinks if `rows` more would not fit."""
        if self.window is not None:
            self._slide(self, rows)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Called before `update` for this step: attention will see the cached prefix plus the new queries.
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_length


class ContiguousKVLayer(CountedKVLayer):
    """One layer's keys and values in buffers of shape [batch, kv_heads, max_length, head_dim]."""

    # bumped whenever any layer's buffers are (re)made: the native decoder keeps its arrays of buffer addresses
    # while this is unchanged instead of rebuilding them on every call (~60 address reads a SmolLM2 step)
    buffer_epoch = 0

    def __init__(self, max_length: int, store: torch.dtype | None = None, one_sequence: bool = False,
                 window: Window | None = None, inv_freq: torch.Tensor | None = None):
        super().__init__()
        self.max_length = max_length
        self.length = 0
        self.store, self.store_one_sequence = store, one_sequence
        self.window, self.inv_freq = window, inv_freq

    def storage_dtype(self, batch: int, states: torch.dtype) -> torch.dtype:
        """What the buffers hold: `store` where set (with `one_sequence`, kv.dtype=auto's rule, only for a batch of
        one: what the native stack reads in place; a batch runs torch's attention, which would widen a copy of
        the whole cache every step), else the keys' and values' own dtype."""
        if self.store is None or (self.store_one_sequence and batch != 1):
            return states
        return self.store

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, k_dim = key_states.shape
        self.allocate(batch, heads, k_dim, value_states.shape[-1], self.storage_dtype(batch, key_states.dtype),
                      key_states.device)

    def allocate(self, batch: int, heads: int, k_dim: int, v_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """The buffers, before the first `update` (the native decoder writes a prompt's keys and values itself)."""
        kw = dict(dtype=dtype, device=device)
        self.device = device
        self.key_buffer = torch.empty(batch, heads, self.max_length, k_dim, **kw)
        self.value_buffer = torch.empty(batch, heads, self.max_length, v_dim, **kw)
        self.is_initialized = True
        ContiguousKVLayer.buffer_epoch += 1

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.length
        self.advance(key_states.shape[-2])  # checks the room first, then counts the slots written below
        self.key_buffer[:, :, start:self.length] = key_states
        self.value_buffer[:, :, start:self.length] = value_states
        if self.key_buffer.dtype != key_states.dtype:  # a narrower store: attention reads the rounded values, widened
            return self.keys.to(key_states.dtype), self.values.to(value_states.dtype)
        return self.keys, self.values

    def advance(self, n: int) -> None:
        """Count the next `n` slots as filled (`update` writes them; the native decoder writes keys and values
        straight into the buffers)."""
        end = self.length + n
        if end > self.max_length:
            hint = ": a windowed cache needs make_room first" if self.window else ""
            raise RuntimeError(f"KV cache overflow: {end} tokens > max_length {self.max_length}{hint}")
        self.length = end

    # the filled prefix, as views made when read: the native decoder advances every layer on every call and never
    # reads them, so making the views there cost ~4 us a layer a call (~1 ms a speculative round on SmolLM2)
    @property
    def keys(self) -> torch.Tensor | None:
        return self.key_buffer[:, :, :self.length] if self.is_initialized else None

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:  # transformers' layer base sets None; anything else would be lost at the next read
            raise AttributeError("a ContiguousKVLayer's keys are a view of its buffer: write key_buffer")

    @property
    def values(self) -> torch.Tensor | None:
        return self.value_buffer[:, :, :self.length] if self.is_initialized else None

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("a ContiguousKVLayer's values are a view of its buffer: write value_buffer")

    def attention_view(self, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots start.. as attention reads them, [batch, heads, >= length - start, dim] (here
        views of the buffers themselves; a shared-KV draft copies its slots from them)."""
        return self.key_buffer[:, :, start:], self.value_buffer[:, :, start:]

    def crop(self, length: int) -> None:
        """Keep the first `length` tokens (a negative value removes that many from the end, as in transformers)."""
        new_length = self.length + length if length < 0 else length
        if not 0 <= new_length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} tokens to {new_length}")
        self.length = new_length

    def reset(self) -> None:
        self.crop(0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows of the batch picked (and repeated) by `beam_idx`: beam search's reorder, and how one prefilled
        context serves several continuations (evaluation's multiple choice)."""
        if self.is_initialized:
            self.key_buffer = self.key_buffer.index_select(0, beam_idx.to(self.device))
            self.value_buffer = self.value_buffer.index_select(0, beam_idx.to(self.device))
            if self.sink_keys is not None:
                self.sink_keys = self.sink_keys.index_select(0, beam_idx.to(self.device))
            ContiguousKVLayer.buffer_epoch += 1

    @property
    def nbytes(self) -> int:
        """Bytes the filled part holds (what a decode step reads), not the preallocated capacity."""
        if not self.is_initialized:
            return 0
        per_token = (self.key_buffer[:, :, :1].numel() * self.key_buffer.element_size()
                     + self.value_buffer[:, :, :1].numel() * self.value_buffer.element_size())
        return per_token * self.length


class LayeredKVCache(Cache):
    """What every croppable cache of ours adds to transformers' `Cache`, over layers that each have `length`,
    `crop` and `nbytes`: the same three for the whole cache."""

    # Set by speculative decoding on the target's cache once the prompt is in: a verify pass's rows must each read
    # the cache as a one-token step at their position would (`read_splits`).
    stepwise_reads = False

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def position(self) -> int:
        """The next token's position: tokens held plus those a window dropped."""
        return self.layers[0].length + getattr(self.layers[0], "dropped", 0)

    # the most rows one call may add (None: any); a windowed cache takes its slack (toolkit/kv/window.py)
    call_rows: int | None = None

    def make_room(self, rows: int) -> None:
        """Before a call adding `rows` tokens: a windowed cache drops what it no longer keeps; others do nothing
        (and, on every decode step, skip the walk over their layers: only a window sets `call_rows`)."""
        if self.call_rows is None:
            return
        for layer in self.layers:
            layer.make_room(rows)

    def read_splits(self, tokens: int) -> list[int]:
        """Offsets 0 < j < tokens at which a pass of `tokens` new tokens must be cut (update and attend piece by
        piece) so that each row reads the cache as a one-token step at its position would. Empty for a cache whose
        reading of the held tokens never depends on its length (full precision); see QuantizedKVCache's."""
        return []

    def crop(self, length: int) -> None:
        for layer in self.layers:
            layer.crop(length)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


class ContiguousKVCache(LayeredKVCache):
    """A full-precision KV cache for `num_layers` layers and up to `max_length` tokens per sequence; `store`,
    `one_sequence`: the buffers' dtype (ContiguousKVLayer.storage_dtype; None = the activations')."""

    def __init__(self, num_layers: int, max_length: int, store: torch.dtype | None = None,
                 one_sequence: bool = False, window: Window | None = None,
                 inv_freqs: list[torch.Tensor] | None = None):
        inv_freqs = inv_freqs or [None] * num_layers
        super().__init__(layers=[ContiguousKVLayer(max_length, store, one_sequence, window, inv_freqs[i])
                                 for i in range(num_layers)])
        self.max_length = max_length
        self.call_rows = window.slack if window is not None else None

    @classmethod
    def for_model(cls, model, max_length: int, store: torch.dtype | None = None,
                  one_sequence: bool = False) -> "ContiguousKVCache":
        config = model.config.get_text_config(decoder=True)
        return cls(config.num_hidden_layers, max_length, store, one_sequence)

    @classmethod
    def windowed(cls, model, window: Window, store: torch.dtype | None = None,
                 one_sequence: bool = False) -> "ContiguousKVCache":
        """A cache of `window.capacity` slots that keeps the sinks and the last tokens (toolkit/kv/window.py); the
        sinks' keys are turned with the model's RoPE frequencies."""
        n = model.config.get_text_config(decoder=True).num_hidden_layers
        freqs = rope_frequencies(model, n, "kv.sink") if window.sink else None
        return cls(n, window.capacity, store, one_sequence, window, freqs)
