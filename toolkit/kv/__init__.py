"""KV caches the engine can run on, chosen by the `kv` config group (conf/kv/): `make_kv_cache` is the one place that
turns a config into a cache, so the engine, the speculative loop, eval and bench never ask which kind they hold.

Every cache honours one interface: transformers' `Cache` (attention calls `update`), plus `crop(length)` (rollback),
`length` (tokens held per sequence) and `nbytes` (bytes it holds for the filled part).

Kinds: fp (toolkit.kv.contiguous.ContiguousKVCache); int8 / int4 / int2 (toolkit.kv.quantized_cache, KIVI-style,
options in toolkit.kv.config); `Int4View` reads a hierarchical INT8 cache as INT4 (toolkit.kv.hierarchical).
"""

from toolkit.errors import InputError
from toolkit.kv.config import KVQuantConfig
from toolkit.kv.contiguous import ContiguousKVCache
from toolkit.kv.hierarchical import Int4View
from toolkit.kv.quantized_cache import QuantizedKVCache

KINDS = ("fp", "int8", "int4", "int2")
_BITS = {"int8": 8, "int4": 4, "int2": 2}

__all__ = ["KINDS", "ContiguousKVCache", "Int4View", "KVQuantConfig", "QuantizedKVCache", "kv_kind", "make_kv_cache",
           "quant_config"]


def kv_kind(kv_cfg) -> str:
    kind = "fp" if kv_cfg is None else (kv_cfg if isinstance(kv_cfg, str) else kv_cfg.get("kind", "fp"))
    if kind not in KINDS:
        raise InputError(f"unknown KV cache kind {kind!r}", f"use kv= one of {', '.join(KINDS)}")
    return kind


def quant_config(kv_cfg) -> KVQuantConfig:
    """The quantized cache's options for a kv config (a kind name alone takes the defaults at its bit width)."""
    kind = kv_kind(kv_cfg)
    if kind == "fp":
        raise InputError("kv=fp has no quantization options", "use kv=int8, int4 or int2")
    node = {} if isinstance(kv_cfg, str) else kv_cfg
    bits = int(node.get("bits", _BITS[kind]))
    if bits != _BITS[kind]:
        raise InputError(f"kv={kind} with kv.bits={bits}", f"drop kv.bits or use kv=int{bits}")
    return KVQuantConfig.from_node({**dict(node), "bits": bits})


def make_kv_cache(model, max_length: int, kv_cfg=None):
    """A cache for `model` holding up to `max_length` tokens per sequence, as `kv_cfg` (a kv config group node, its
    kind as a string, or None = full precision) says."""
    if kv_kind(kv_cfg) == "fp":
        return ContiguousKVCache.for_model(model, max_length)
    return QuantizedKVCache.for_model(model, max_length, quant_config(kv_cfg))
