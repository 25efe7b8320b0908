"""The INT4 reading of a hierarchical INT8 cache (QuantSpec self-speculation): a draft reads only the high 4-bit
planes of the same memory the target reads as INT8, halving the quantized bytes a draft step streams.

`Int4View(cache)` is a transformers `Cache` over the SAME layers: an `update` through it appends to the shared
cache (full-precision residual, flushes, shadow: exactly what the target would store) but returns the quantized
part dequantized from the high planes only. The residual is full precision for both readers. A speculative loop
drafts through the view, crops the draft tokens off the shared cache, and verifies through the cache itself.
"""

from transformers.cache_utils import Cache, CacheLayerMixin

from toolkit.errors import InputError


class Int4ViewLayer(CacheLayerMixin):
    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    @property
    def is_initialized(self):
        return self.layer.is_initialized

    @is_initialized.setter
    def is_initialized(self, value):
        pass  # the shared layer owns its state

    def lazy_initialization(self, key_states, value_states):
        self.layer.lazy_initialization(key_states, value_states)

    def update(self, key_states, value_states, *args, **kwargs):
        return self.layer.update(key_states, value_states, hi_only=True)

    def get_mask_sizes(self, query_length):
        return self.layer.get_mask_sizes(query_length)

    def get_seq_length(self):
        return self.layer.get_seq_length()

    def get_max_length(self):
        return self.layer.get_max_length()

    def crop(self, length):
        self.layer.crop(length)

    def reset(self):
        self.layer.reset()


class Int4View(Cache):
    """The INT4 view of a `QuantizedKVCache` built with `kv.hierarchical=true`."""

    def __init__(self, cache):
        if not getattr(getattr(cache, "cfg", None), "hierarchical", False):
            raise InputError("an INT4 view needs a hierarchical INT8 KV cache",
                             "build the cache with kv=int8 kv.hierarchical=true")
        super().__init__(layers=[Int4ViewLayer(layer) for layer in cache.layers])
        self.cache = cache
        self.max_length = cache.max_length

    @property
    def length(self) -> int:
        return self.cache.length

    def crop(self, length: int) -> None:
        self.cache.crop(length)

    @property
    def nbytes(self) -> int:
        """Bytes a draft step reads through the view: the high planes, scales/minima, residual (and shadow)."""
        return self.cache.nbytes - sum(layer.k_codes[1][:, :, :1].numel() * (layer.quantized + layer.v_quantized)
                                       for layer in self.cache.layers if layer.is_initialized)
