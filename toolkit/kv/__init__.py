"""KV caches the engine can run on, chosen by the `kv` config group (conf/kv/): `make_kv_cache` is the one place that
turns a config into a cache, so the engine, the speculative loop, eval and bench never ask which kind they hold.

Every cache honours one interface: transformers' `Cache` (attention calls `update`), plus `crop(length)` (rollback),
`length` (tokens held per sequence) and `nbytes` (bytes it holds for the filled part).
"""

from toolkit.engine.kv_cache import ContiguousKVCache
from toolkit.errors import InputError

KINDS = ("fp",)


def kv_kind(kv_cfg) -> str:
    kind = "fp" if kv_cfg is None else (kv_cfg if isinstance(kv_cfg, str) else kv_cfg.get("kind", "fp"))
    if kind not in KINDS:
        raise InputError(f"unknown KV cache kind {kind!r}", f"use kv= one of {', '.join(KINDS)}")
    return kind


def make_kv_cache(model, max_length: int, kv_cfg=None):
    """A cache for `model` holding up to `max_length` tokens per sequence, as `kv_cfg` (a kv config group node, its
    kind as a string, or None = full precision) says."""
    kv_kind(kv_cfg)
    return ContiguousKVCache.for_model(model, max_length)
