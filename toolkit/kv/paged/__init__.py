"""Paged KV cache for serving: a block pool with per-sequence block tables, prefix caching (reference counted,
copy-on-write, LRU eviction) and rollback by freeing tail blocks. See cache.py for the calling convention."""

from toolkit.kv.paged.cache import PagedKVCache, PagedSequence
from toolkit.kv.paged.pool import BlockPool, OutOfBlocks, PoolStats

__all__ = ["BlockPool", "OutOfBlocks", "PagedKVCache", "PagedSequence", "PoolStats"]
