"""The server's KV memory: one paged block pool (toolkit.kv.paged) shared by every running sequence, sized once at
start, and the block arithmetic admission needs.

The pool's size comes from `max_kv_tokens` (tokens, rounded up to whole blocks; model-independent, the default) or,
when set, `kv_budget_mb` (MiB of keys/values: as many blocks as fit). A request whose prompt + max_tokens needs more
blocks than the whole pool can never run, and is refused at submission.

With kv=int8|int4|int2 the blocks are quantized (toolkit.kv.paged.quantized_storage): sealed blocks hold codes, and
the recent tokens of every sequence sit in full-precision staging slots, sized here for `max_sequences` rows adding
`step_tokens` per call plus one prefill of `prefill_tokens` (the longest prompt). A kv_budget_mb pool holds the
staging slots and as many quantized blocks as the rest of the budget allows (`plan_pool`).
"""

from dataclasses import dataclass

from toolkit.kv import KVSpec, kv_spec
from toolkit.kv.paged import PagedKVCache
from toolkit.kv.paged.quantized_storage import paged_cache_for, plan_pool


def make_cache(model, max_kv_tokens: int, block_size: int, kv_budget_mb: float | None,
               prefix_cache: bool = True, kv: KVSpec | None = None, max_sequences: int = 16, step_tokens: int = 1,
               prefill_tokens: int = 2048) -> PagedKVCache:
    if not kv_spec(kv).quantized:
        if kv_budget_mb is not None:
            return PagedKVCache.with_budget(model, int(kv_budget_mb * 2**20), block_size, prefix_cache=prefix_cache)
        return PagedKVCache(model, -(-max_kv_tokens // block_size), block_size, prefix_cache=prefix_cache)
    sizing = dict(max_sequences=max_sequences, step_tokens=step_tokens, prefill_tokens=prefill_tokens)
    if kv_budget_mb is not None:
        plan = plan_pool(model, kv, int(kv_budget_mb * 2**20), block_size, **sizing)
        return paged_cache_for(model, kv, plan.num_blocks, block_size, prefix_cache, staging_slots=plan.staging_slots)
    return paged_cache_for(model, kv, -(-max_kv_tokens // block_size), block_size, prefix_cache, **sizing)


def residual_tokens(kv: KVSpec | None) -> int | None:
    """How far behind its sequence's end a quantized block is sealed (None for kv=fp: nothing is ever sealed)."""
    return kv_spec(kv).residual


def staging_blocks(cache: PagedKVCache, tokens: int) -> int:
    """Staging slots a prefill of `tokens` new tokens takes until its commit (0 for full-precision blocks)."""
    return cache.pool.blocks_for(tokens) if hasattr(cache.storage, "staging_available") else 0


@dataclass(frozen=True)
class PrefillCost:
    blocks: int  # how much pool.available drops when the sequence is admitted and prefilled
    compute_tokens: int  # prompt tokens the model runs (those past the cached prefix)


def prefill_cost(cache: PagedKVCache, ids: list[int], reuse_prefix: bool) -> PrefillCost:
    """What admitting a sequence of context `ids` costs, without admitting it (no blocks retained, no prefix-cache
    statistics counted: a head of the queue waiting for room is looked at every turn).

    Peeks at the same prefix keys as `cache.new_sequence` (whole blocks, leaving at least one token to run). Matched
    blocks nobody references are in `pool.available` now and leave it once retained; the rest of the prompt takes
    fresh blocks (it starts at a block boundary, so no copy-on-write)."""
    pool = cache.pool
    blocks = pool.peek_prefix(ids, len(ids) - 1) if reuse_prefix and cache.prefix_cache else []
    idle = sum(pool.ref_count[b] == 0 for b in blocks)
    return PrefillCost(pool.blocks_for(len(ids)) - len(blocks) + idle, len(ids) - len(blocks) * cache.block_size)
