"""The paged KV cache: the block pool's bookkeeping on its own, then the cache inside real (tiny) models against the
engine's contiguous cache — outputs identical with and without paging and with and without prefix reuse, reference
counts back to zero, copy-on-write never altering a shared block, eviction under a tiny budget."""

import random

import pydoc_data.topics
import pytest
import torch

from toolkit.engine.generate import generate, paged_forward
from toolkit.kv.paged import BlockPool, OutOfBlocks, PagedKVCache

# ---- the pool alone ------------------------------------------------------------------------------------------


def test_pool_allocates_releases_and_keeps_invariants():
    pool = BlockPool(4, 2)
    blocks = [pool.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3] and pool.used == 4 and pool.available == 0
    with pytest.raises(OutOfBlocks):
        pool.allocate()
    pool.retain(blocks[0])
    pool.release(blocks[0])
    assert pool.used == 4
    for b in blocks:
        pool.release(b)
    assert pool.used == 0 and pool.available == 4
    pool.check()
    with pytest.raises(RuntimeError):
        pool.release(blocks[0])


def test_prefix_keys_chain_and_eviction_is_lru():
    pool = BlockPool(3, 2)
    a, b = pool.allocate(), pool.allocate()
    ka = pool.register(a, 0, (1, 2))
    pool.register(b, ka, (3, 4))
    assert pool.lookup(0, (1, 2)) == a and pool.lookup(ka, (3, 4)) == b
    assert pool.lookup(0, (3, 4)) is None  # the same tokens after another prefix are another key
    pool.release(a)
    pool.release(b)
    assert pool.used == 0 and list(pool.cached) == [a, b]
    found, _ = pool.match_prefix([1, 2, 3, 4, 5], 4)
    assert found == [a, b] and pool.used == 2  # matched blocks are retained for the caller
    pool.release(b)
    pool.release(a)  # now a is the most recently used
    c = pool.allocate()  # the free block first
    d = pool.allocate()  # then the least recently used cached one: b
    assert d == b and pool.lookup(ka, (3, 4)) is None and pool.lookup(0, (1, 2)) == a
    assert pool.stats.evictions == 1
    pool.release(c)
    pool.release(d)
    pool.check()


def test_match_prefix_counts_hits_per_block():
    pool = BlockPool(8, 2)
    a = pool.allocate()
    pool.register(a, 0, (7, 7))
    pool.release(a)
    blocks, _ = pool.match_prefix([7, 7, 1, 1, 2, 2], 6)
    assert blocks == [a] and pool.stats.prefix_hits == 1 and pool.stats.prefix_queries == 3


def test_a_second_block_with_a_known_prefix_stays_unregistered():
    pool = BlockPool(4, 2)
    a, b = pool.allocate(), pool.allocate()
    assert pool.register(a, 0, (5, 6)) == pool.register(b, 0, (5, 6))
    assert pool.is_registered(a) and not pool.is_registered(b)
    pool.release(b)
    assert b in pool.free  # nothing can find it again
    pool.check()


# ---- the cache in a model ------------------------------------------------------------------------------------

def _prompts(tokenizer, n=6, shared_tokens=40, seed=0):
    texts = list(pydoc_data.topics.topics.values())
    rng = random.Random(seed)
    shared = tokenizer(texts[3][:600]).input_ids[:shared_tokens]
    out = []
    for i in range(n):
        own = tokenizer(texts[10 + i][:300]).input_ids[:rng.randint(3, 30)]
        out.append(shared + own if i % 2 == 0 else own + shared[:rng.randint(1, 20)])
    return out


def _run(model, cache, seq, tokens):
    return paged_forward(model, cache, seq, tokens)


def _paged_greedy(model, cache, prompts, new_tokens, reuse_prefix=True, one_at_a_time=False):
    """Admit each prompt (prefill alone), then decode all together; returns the generated ids and sequences."""
    seqs, outs = [], []
    for p in prompts:
        seq = cache.new_sequence(p, reuse_prefix=reuse_prefix)
        logits = _run(model, cache, [seq], [p[seq.length:]])
        seqs.append(seq)
        outs.append([int(logits[0].argmax())])
        if one_at_a_time:  # finish this one before the next arrives: later prompts find its blocks cached
            for _ in range(new_tokens - 1):
                outs[-1].append(int(_run(model, cache, [seq], [[outs[-1][-1]]])[0].argmax()))
    if not one_at_a_time:
        for _ in range(new_tokens - 1):
            logits = _run(model, cache, seqs, [[o[-1]] for o in outs])
            for o, row in zip(outs, logits):
                o.append(int(row.argmax()))
    return outs, seqs


@pytest.mark.parametrize("reuse", [False, True])
def test_paged_greedy_equals_engine_generate(tiny_model, reuse):
    model, tokenizer = tiny_model
    prompts = _prompts(tokenizer)
    expected = [generate(model, tokenizer, [p], 10, stop_tokens=set()).sequences[0].token_ids for p in prompts]
    cache = PagedKVCache(model, num_blocks=128, block_size=8)
    outs, seqs = _paged_greedy(model, cache, prompts, 10, reuse_prefix=reuse)
    assert outs == expected
    assert (cache.pool.stats.prefix_hits > 0) == reuse
    assert any(s.cached_tokens for s in seqs) == reuse
    for s in seqs:
        cache.free(s)
    assert cache.pool.used == 0
    cache.pool.check()


def test_generated_tokens_are_cached_too(tiny_model):
    """A follow-up turn (prompt + answer + more) reuses the blocks the answer filled."""
    model, tokenizer = tiny_model
    prompt = _prompts(tokenizer)[0]
    cache = PagedKVCache(model, num_blocks=64, block_size=4)
    outs, (seq,) = _paged_greedy(model, cache, [prompt], 12)
    held = list(seq.tokens)
    cache.free(seq)
    follow_up = held + outs[0][-1:] + [5, 6, 7]
    again = cache.new_sequence(follow_up)
    assert again.length == len(held) // 4 * 4 and again.length > len(prompt)  # every full block it wrote
    cache.free(again)
    cache.pool.check()


def test_crop_then_append_equals_never_having_gone_there(tiny_model):
    """Speculative rollback: crop frees the tail blocks, and decoding on gives the same logits as a sequence that
    never held the rejected tokens."""
    model, tokenizer = tiny_model
    prompt = _prompts(tokenizer)[1]
    cache = PagedKVCache(model, num_blocks=64, block_size=4)
    seq = cache.new_sequence(prompt, reuse_prefix=False)
    first = _run(model, cache, [seq], [prompt])
    nxt = int(first[0].argmax())
    length = seq.length
    _run(model, cache, [seq], [[nxt, 11, 12, 13, 14, 15]])  # a verify pass whose draft is rejected after `nxt`
    blocks_before = cache.pool.used
    cache.crop_sequence(seq, length + 1)
    assert cache.pool.used < blocks_before and seq.length == length + 1
    after_crop = _run(model, cache, [seq], [[21]])

    fresh_cache = PagedKVCache(model, num_blocks=64, block_size=4)
    fresh = fresh_cache.new_sequence(prompt, reuse_prefix=False)
    _run(model, fresh_cache, [fresh], [prompt])
    _run(model, fresh_cache, [fresh], [[nxt]])
    expected = _run(model, fresh_cache, [fresh], [[21]])
    torch.testing.assert_close(after_crop, expected, rtol=1e-5, atol=1e-5)
    cache.free(seq)
    assert cache.pool.used == 0
    cache.pool.check()


def test_copy_on_write_never_alters_a_shared_block(tiny_model):
    model, tokenizer = tiny_model
    prompt = _prompts(tokenizer)[0][:33]  # 8 full blocks of 4 + 1
    cache = PagedKVCache(model, num_blocks=64, block_size=4)
    owner = cache.new_sequence(prompt)
    _run(model, cache, [owner], [prompt])
    sharer = cache.new_sequence(prompt)  # finds 8 blocks
    assert sharer.blocks == owner.blocks[:8]
    shared_block = sharer.blocks[7]
    snapshot = [(k[shared_block * 4:shared_block * 4 + 4].clone(), v[shared_block * 4:shared_block * 4 + 4].clone())
                for k, v in zip(cache.storage.keys, cache.storage.values)]
    cache.crop_sequence(sharer, 30)  # into the shared block: its next write must copy it first
    _run(model, cache, [sharer], [[9, 9, 9]])
    assert sharer.blocks[7] != shared_block and cache.pool.stats.cow_copies == 1
    for (k0, v0), k, v in zip(snapshot, cache.storage.keys, cache.storage.values):
        assert torch.equal(k[shared_block * 4:shared_block * 4 + 4], k0)
        assert torch.equal(v[shared_block * 4:shared_block * 4 + 4], v0)
    cache.free(owner)
    cache.free(sharer)
    assert cache.pool.used == 0
    cache.pool.check()


def test_sole_owner_writing_into_a_registered_block_unregisters_it(tiny_model):
    model, tokenizer = tiny_model
    prompt = _prompts(tokenizer)[0][:17]
    cache = PagedKVCache(model, num_blocks=32, block_size=4)
    seq = cache.new_sequence(prompt)
    _run(model, cache, [seq], [prompt])
    block = seq.blocks[3]
    assert cache.pool.is_registered(block)
    cache.crop_sequence(seq, 14)
    _run(model, cache, [seq], [[1]])
    assert not cache.pool.is_registered(block)  # its key would now lie about its tokens
    later = cache.new_sequence(prompt)
    assert later.length == 12  # blocks 0..2 only
    cache.free(seq)
    cache.free(later)
    cache.pool.check()


def test_tiny_budget_evicts_and_stays_correct(tiny_model):
    """Prompts served one after another in a pool that holds little more than one sequence: cached prefixes are
    evicted (LRU) to make room, and every output still equals the engine's."""
    model, tokenizer = tiny_model
    prompts = _prompts(tokenizer, n=6)
    need = max(-(-(len(p) + 8) // 4) for p in prompts)
    cache = PagedKVCache(model, num_blocks=need + 2, block_size=4)
    expected = [generate(model, tokenizer, [p], 8, stop_tokens=set()).sequences[0].token_ids for p in prompts]
    got = []
    for p in prompts:
        outs, (seq,) = _paged_greedy(model, cache, [p], 8, one_at_a_time=True)
        got.append(outs[0])
        cache.free(seq)
        cache.pool.check()
    assert got == expected
    assert cache.pool.stats.evictions > 0 and cache.pool.stats.prefix_hits > 0
    assert cache.pool.used == 0


def test_out_of_blocks_is_an_error_not_a_corruption(tiny_model):
    model, tokenizer = tiny_model
    prompt = _prompts(tokenizer)[0]
    cache = PagedKVCache(model, num_blocks=2, block_size=4)
    seq = cache.new_sequence(prompt)
    with pytest.raises(OutOfBlocks):
        cache.bind([seq], [prompt])
    cache.free(seq)
    assert cache.pool.used == 0
    cache.pool.check()


def test_budget_sizing_and_bytes(tiny_model):
    model, _ = tiny_model
    per_block = PagedKVCache.bytes_per_block(model, 16)
    cache = PagedKVCache.with_budget(model, 10 * per_block + 5, 16)
    assert cache.pool.num_blocks == 10 and cache.storage.nbytes == 10 * per_block
    with pytest.raises(ValueError, match="holds no"):
        PagedKVCache.with_budget(model, per_block - 1, 16)


def test_paged_equals_engine_on_smollm2_with_a_shared_system_prompt(smollm2):
    """The real model, fp32: a long shared prefix reused by later requests changes no greedy token."""
    model, tokenizer = smollm2.model, smollm2.tokenizer
    texts = list(pydoc_data.topics.topics.values())
    system = tokenizer(texts[5]).input_ids[:200]
    prompts = [system + tokenizer(f" Question {i}: what does this say about {w}?").input_ids
               for i, w in enumerate(["names", "errors", "loops"])]
    expected = [generate(model, tokenizer, [p], 12, stop_tokens=set()).sequences[0].token_ids for p in prompts]
    cache = PagedKVCache(model, num_blocks=256, block_size=16)
    outs, seqs = _paged_greedy(model, cache, prompts, 12)
    assert [s.cached_tokens for s in seqs][1:] == [192, 192]
    assert outs == expected


def test_without_prefix_cache_nothing_is_registered_or_kept(tiny_model):
    model, tokenizer = tiny_model
    prompts = _prompts(tokenizer)
    cache = PagedKVCache(model, num_blocks=128, block_size=8, prefix_cache=False)
    outs, seqs = _paged_greedy(model, cache, prompts, 6)
    assert not cache.pool.key_of and cache.pool.stats.prefix_queries == 0
    for s in seqs:
        cache.free(s)
    assert cache.pool.available == cache.pool.num_blocks and not cache.pool.cached
    cache.pool.check()


def test_peek_prefix_retains_and_counts_nothing():
    pool = BlockPool(4, 2)
    a = pool.allocate()
    pool.register(a, 0, (1, 2))
    pool.release(a)
    assert pool.peek_prefix([1, 2, 3, 4, 5], 4) == [a]
    assert pool.used == 0 and pool.stats.prefix_queries == 0


def test_a_bind_that_runs_dry_gives_back_what_it_took(tiny_model):
    model, tokenizer = tiny_model
    prompts = _prompts(tokenizer)[:2]
    cache = PagedKVCache(model, num_blocks=40, block_size=4)
    outs, seqs = _paged_greedy(model, cache, prompts, 2)
    used = cache.pool.used
    with pytest.raises(OutOfBlocks):
        cache.bind(seqs, [[1] * 60, [1] * 60])  # the first row's blocks fit, the second's do not
    assert cache.pool.used == used and [s.length for s in seqs] == [len(p) + 1 for p in prompts]
    for s in seqs:
        cache.free(s)
    cache.pool.check()
