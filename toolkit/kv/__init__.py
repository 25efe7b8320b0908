"""KV caches the engine can run on, chosen by the `kv` config group (conf/kv/), resolved once by the CLI into a
`KVSpec` (toolkit.kv.config): `make_kv_cache` is the one place that turns a KVSpec into a cache, so the engine, the
speculative loop, eval and bench never ask which kind they hold.

Every cache honours one interface: transformers' `Cache` (attention calls `update`), plus `crop(length)` (rollback),
`length` (tokens held per sequence) and `nbytes` (bytes it holds for the filled part).

Kinds: fp (toolkit.kv.contiguous.ContiguousKVCache; with kv.window, the sinks and the last tokens only:
toolkit.kv.window); int8 / int4 / int2 (toolkit.kv.quantized_cache, KIVI-style,
options in toolkit.kv.config); `Int4View` reads a hierarchical INT8 cache as INT4 (toolkit.kv.hierarchical).
"""

from toolkit.errors import InputError
from toolkit.kv.config import KINDS, KVQuantConfig, KVSpec, fp_storage
from toolkit.kv.contiguous import ContiguousKVCache
from toolkit.kv.hierarchical import Int4View
from toolkit.kv.quantized_cache import QuantizedKVCache

__all__ = ["KINDS", "ContiguousKVCache", "Int4View", "KVQuantConfig", "KVSpec", "QuantizedKVCache", "kv_spec",
           "make_kv_cache", "quant_config"]


def kv_spec(kv) -> KVSpec:
    """`kv` as the KVSpec the library takes: a KVSpec as it is, None as full precision. Anything else (a config node,
    a kind name) was not resolved at the boundary: resolve it once with KVSpec.from_node."""
    if kv is None:
        return FP
    if not isinstance(kv, KVSpec):
        raise TypeError(f"the KV cache settings are a KVSpec, got {type(kv).__name__}: resolve a kv config node once "
                        "with KVSpec.from_node (the CLI does)")
    return kv


FP = KVSpec()


def quant_config(kv) -> KVQuantConfig:
    """The quantized cache's options of a kv node, kind name or KVSpec (KVSpec.from_node's; kv=fp has none)."""
    spec = KVSpec.from_node(kv)
    if spec.quant is None:
        raise InputError("kv=fp has no quantization options", "use kv=int8, int4 or int2")
    return spec.quant


def make_kv_cache(model, max_length: int, kv: KVSpec | None = None):
    """A cache for `model` holding up to `max_length` tokens per sequence, as `kv` (a KVSpec; None = full
    precision) says."""
    kv = kv_spec(kv)
    window = kv.window_shape()
    if window is not None and max_length > window.capacity:  # a cache that could fill: it slides
        if kv.quant is not None:
            return QuantizedKVCache.windowed(model, window, kv.quant)
        return ContiguousKVCache.windowed(model, window, *fp_storage(model, kv))
    if kv.quant is None:
        return ContiguousKVCache.for_model(model, max_length, *fp_storage(model, kv))
    return QuantizedKVCache.for_model(model, max_length, kv.quant)
