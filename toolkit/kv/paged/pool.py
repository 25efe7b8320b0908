"""The block allocator behind the paged KV cache: which physical block each sequence's tokens live in, who shares
it, and which finished blocks can be found again by their token prefix. Pure bookkeeping (no tensors), so every
rule is tested on its own.

A block holds `block_size` consecutive tokens of one sequence. A block is in one of three states:
  * referenced: in at least one live sequence's block table (ref_count > 0);
  * cached: unreferenced but full and registered under its prefix key, kept for reuse until memory runs short
    (least recently used first);
  * free: nothing in it anyone can ask for.

Prefix keys: a full block's key is (key of the block before it, its tokens). Keys are chained, so equal keys mean
equal whole prefixes, and they are exact tuples, never hashes that could collide. `key ids` (small integers) stand
for the parent key so a key's size does not grow with its position.
"""

from collections import OrderedDict
from dataclasses import dataclass


class OutOfBlocks(RuntimeError):
    """Every block is referenced by a live sequence: nothing is free and nothing cached can be evicted."""


@dataclass
class PoolStats:
    prefix_queries: int = 0  # full prompt blocks looked up
    prefix_hits: int = 0  # of which found cached
    evictions: int = 0
    cow_copies: int = 0

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


ROOT = 0  # the key id of the empty prefix


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_count = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.cached: OrderedDict[int, None] = OrderedDict()  # unreferenced registered blocks, oldest first
        self.key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # registered block -> its prefix key
        self.block_of: dict[tuple[int, tuple[int, ...]], int] = {}  # prefix key -> block
        self.key_id: dict[int, int] = {}  # registered block -> id standing for its key (parent of the next key)
        self._next_key_id = ROOT + 1
        self.stats = PoolStats()

    # --- counts -------------------------------------------------------------------------------------------------
    @property
    def used(self) -> int:
        """Blocks referenced by live sequences."""
        return self.num_blocks - len(self.free) - len(self.cached)

    @property
    def available(self) -> int:
        """Blocks an allocation can get: free ones plus cached ones it may evict."""
        return len(self.free) + len(self.cached)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # --- allocation ---------------------------------------------------------------------------------------------
    def allocate(self) -> int:
        """A block for one sequence to write into (ref_count 1): a free one, else the least recently used cached
        one (its prefix key is forgotten)."""
        if self.free:
            block = self.free.pop()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            self._unregister(block)
            self.stats.evictions += 1
        else:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        self.ref_count[block] = 1
        return block

    def evict(self, block: int) -> None:
        """Forget a cached (unreferenced, registered) block now and free it, as allocation's LRU eviction does."""
        if block not in self.cached:
            raise RuntimeError(f"block {block} is not cached")
        del self.cached[block]
        self._unregister(block)
        self.free.append(block)
        self.stats.evictions += 1

    def retain(self, block: int) -> None:
        if self.ref_count[block] == 0:
            self.cached.pop(block, None)  # back in use: no longer a candidate for eviction
        self.ref_count[block] += 1

    def release(self, block: int) -> None:
        if self.ref_count[block] <= 0:
            raise RuntimeError(f"block {block} released more often than retained")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            if block in self.key_of:
                self.cached[block] = None  # most recently used at the end
            else:
                self.free.append(block)

    # --- prefix cache ---------------------------------------------------------------------------------------------
    def register(self, block: int, parent: int, tokens: tuple[int, ...]) -> int:
        """Record that full `block` holds `tokens` after the prefix whose key id is `parent`; return the key id of
        the prefix it ends. If another block already holds that prefix, this one stays unregistered (both are
        valid; lookups find the first) and the existing key id is returned."""
        if len(tokens) != self.block_size:
            raise ValueError("only full blocks are registered")
        key = (parent, tokens)
        existing = self.block_of.get(key)
        if existing is not None:
            return self.key_id[existing]
        if block in self.key_of:
            raise RuntimeError(f"block {block} is already registered")
        self.key_of[block], self.block_of[key] = key, block
        self.key_id[block] = self._next_key_id
        self._next_key_id += 1
        return self.key_id[block]

    def lookup(self, parent: int, tokens: tuple[int, ...]) -> int | None:
        return self.block_of.get((parent, tokens))

    def is_registered(self, block: int) -> bool:
        return block in self.key_of

    def _unregister(self, block: int) -> None:
        key = self.key_of.pop(block)
        del self.block_of[key]
        del self.key_id[block]

    def unregister(self, block: int) -> None:
        """Forget a referenced block's key (its owner is about to write into it)."""
        if block in self.key_of:
            self._unregister(block)

    def peek_prefix(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """The registered blocks covering the longest prefix of `token_ids` (at most `max_tokens` tokens, whole
        blocks only), in order. A dry look: nothing retained, nothing counted (admission prices a waiting request
        with it every turn)."""
        bs = self.block_size
        blocks, parent = [], ROOT
        for start in range(0, max_tokens - bs + 1, bs):
            block = self.lookup(parent, tuple(token_ids[start:start + bs]))
            if block is None:
                break
            blocks.append(block)
            parent = self.key_id[block]
        return blocks

    def match_prefix(self, token_ids: list[int], max_tokens: int) -> tuple[list[int], int]:
        """`peek_prefix`, and the blocks retained for the caller; returns them and the key id their prefix ends at.
        Counts one query per whole prompt block (found or not), so the hit rate is per prompt block."""
        blocks = self.peek_prefix(token_ids, max_tokens)
        self.stats.prefix_queries += max(0, max_tokens // self.block_size)
        self.stats.prefix_hits += len(blocks)
        for block in blocks:
            self.retain(block)
        return blocks, (self.key_id[blocks[-1]] if blocks else ROOT)

    def check(self) -> None:
        """Invariants (tests call this): every block in exactly one state; keys and blocks agree."""
        free, cached = set(self.free), set(self.cached)
        assert len(free) == len(self.free), "a block is free twice"
        assert not free & cached, "a block is both free and cached"
        for block in range(self.num_blocks):
            referenced = self.ref_count[block] > 0
            assert referenced + (block in free) + (block in cached) == 1, f"block {block} in {referenced=} " \
                f"free={block in free} cached={block in cached}"
            assert block not in cached or block in self.key_of, f"cached block {block} has no key"
            assert block not in free or block not in self.key_of, f"free block {block} still has a key"
        for block, key in self.key_of.items():
            assert self.block_of[key] == block
