"""Quantized paged KV blocks (toolkit.kv.paged.quantized_storage): bit-exact with fp while nothing is sealed, sealed
blocks within the quantizer's bound, exact copy-on-write and crop, the byte formula, staging exhaustion and reuse,
and INT8 generation on the real SmolLM2."""

import pytest
import torch

from toolkit.errors import InputError
from toolkit.kv import KVSpec
from toolkit.kv.paged import OutOfBlocks, PagedKVCache
from toolkit.kv.paged.quantized_storage import (
    QuantizedBlockStorage,
    paged_cache_for,
    paged_storage_for,
    plan_pool,
    staging_slots_for,
)
from toolkit.kv.paged.storage import FPBlockStorage


def _prompts(tokenizer, lengths=(40, 17, 33, 64, 5)):
    import pydoc_data.topics

    texts = list(pydoc_data.topics.topics.values())
    prompts = [tokenizer(texts[i][:400]).input_ids[:n] for i, n in enumerate(lengths)]
    shared = tokenizer(texts[7][:400]).input_ids[:40]
    return prompts + [shared + tokenizer(f" user turn {i}").input_ids for i in range(3)]


@torch.inference_mode()
def _generate(model, cache, prompts, steps, reuse_prefix=True):
    """Prefill each prompt alone, then decode them all together; (sequences, greedy tokens, last logits)."""
    def call(seqs, tokens):
        positions, mask = cache.bind(seqs, tokens)
        logits = model(input_ids=torch.tensor(tokens), position_ids=positions, attention_mask=mask, cache=cache,
                       use_cache=True).logits[:, -1]
        cache.commit()
        return logits

    seqs, outs, last = [], [], []
    for prompt in prompts:
        seq = cache.new_sequence(prompt, reuse_prefix)
        logits = call([seq], [prompt[seq.length:]])
        seqs.append(seq)
        outs.append([int(logits.argmax())])
    for _ in range(steps - 1):
        last = call(seqs, [[o[-1]] for o in outs])
        for o, row in zip(outs, last):
            o.append(int(row.argmax()))
    return seqs, outs, last


def _storage(bits=4, num_blocks=16, block_size=8, heads=2, dim=16, residual=0, slots=8, layers=2, group=32):
    return QuantizedBlockStorage(layers, num_blocks, block_size, heads, dim, torch.float32, bits=bits,
                                 residual_tokens=residual, staging_slots=slots, value_group=group)


def _fill(storage, block, seed):
    """Random keys/values (channels at different offsets, as real keys have) into all of `block`'s slots."""
    g = torch.Generator().manual_seed(seed)
    B, H, D = storage.block_size, storage.kv_heads, storage.head_dim
    kv = []
    for layer in range(storage.num_layers):
        k = torch.randn(1, H, B, D, generator=g) * 2 + torch.linspace(-4, 4, D)
        v = torch.randn(1, H, B, D, generator=g)
        storage.write(layer, torch.arange(block * B, (block + 1) * B), k, v)
        kv.append((k[0], v[0]))
    return kv


def _read_block(storage, layer, block):
    B = storage.block_size
    k, v = storage.gather(layer, torch.arange(block * B, (block + 1) * B)[None])
    return k[0], v[0]


# ---- exactness while nothing is sealed ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["int8", "int4", "int2"])
def test_residual_covering_the_sequences_is_bit_exact_with_fp(tiny_model, kind):
    model, tokenizer = tiny_model
    prompts = _prompts(tokenizer)
    fp = PagedKVCache(model, num_blocks=64, block_size=8)
    _, fp_tokens, fp_logits = _generate(model, fp, prompts, 12)
    cache = paged_cache_for(model, KVSpec.from_node({"kind": kind, "residual": 128}), num_blocks=64, block_size=8)
    seqs, tokens, logits = _generate(model, cache, prompts, 12)
    assert isinstance(cache.storage, QuantizedBlockStorage) and not any(cache.storage.sealed)
    assert tokens == fp_tokens
    assert torch.equal(logits, fp_logits)
    assert cache.pool.stats.prefix_hits > 0  # the shared prompt was reused


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_sealed_blocks_change_little_and_free_their_staging(tiny_model, kind):
    model, tokenizer = tiny_model
    prompts = _prompts(tokenizer)
    _, _, fp_logits = _generate(model, PagedKVCache(model, num_blocks=64, block_size=8), prompts, 12)
    cache = paged_cache_for(model, KVSpec.from_node({"kind": kind, "residual": 8}), num_blocks=64, block_size=8)
    seqs, _, logits = _generate(model, cache, prompts, 12)
    storage = cache.storage
    assert all(s.sealed == max(0, s.length - 8) // 8 for s in seqs)
    sealed = sum(storage.sealed)
    assert sealed > 10
    storage.settle()  # quantize the blocks the last commit sealed
    for s in seqs:  # a block is sealed or staged, never both: sealing gave the slot back
        assert all(storage.sealed[b] != (storage.slot_of[b] != -1) for b in s.blocks)
    assert torch.isfinite(logits).all() and not torch.equal(logits, fp_logits)
    if kind == "int8":  # (int4 flips greedy tokens of this chaotic random model, so its later logits diverge)
        assert (logits - fp_logits).abs().max() / fp_logits.abs().max() < 0.05
    for s in seqs:
        cache.free(s)
    cache.pool.check()
    assert cache.pool.used == 0


# ---- sealed blocks ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4, 2])
def test_sealed_block_error_within_the_quantizers_bound(bits):
    s = _storage(bits=bits)
    for block in (0, 3):
        s.reset_block(block)
    kv = _fill(s, 3, seed=bits)
    _fill(s, 0, seed=99)
    before = _read_block(s, 1, 3)
    assert torch.equal(before[0], kv[1][0]) and torch.equal(before[1], kv[1][1])  # staged: exact
    s.seal_block(3)
    s.seal_block(3)  # idempotent
    assert s.is_sealed(3) and not s.is_sealed(0)
    for layer in range(s.num_layers):
        k, v = _read_block(s, layer, 3)
        true_k, true_v = kv[layer]
        k_bound = s.k_scale[layer][:, 3][:, None, :].float() / 2 * (1 + 1e-5) + 1e-6  # per channel over the block
        v_bound = s.v_scale[layer][:, 24:32].float().repeat_interleave(s.value_group, -1) / 2 * (1 + 1e-5) + 1e-6
        assert ((k - true_k).abs() <= k_bound).all() and ((v - true_v).abs() <= v_bound).all()
        assert (k != true_k).any()
        assert s.k_scale[layer][:, 3].float().max() < (true_k.amax(1) - true_k.amin(1)).max() / (2**bits - 1) * 1.01
    assert s.slot_of[3] == -1 and s.staging_free == s.staging_slots - 1  # its slot is back; block 0 holds one


def test_a_gather_mixes_sealed_and_staged_slots_in_any_order():
    s = _storage(bits=8)
    for block in range(4):
        s.reset_block(block)
        _fill(s, block, seed=block)
    s.seal_block(1)
    s.seal_block(2)
    B = s.block_size
    index = torch.tensor([[3 * B + 1, 1 * B, 0, 2 * B + 5], [2 * B + 7, 3 * B, 1 * B + 3, 0]])
    k, v = s.gather(0, index)
    for r in range(2):
        for c in range(4):
            slot = int(index[r, c])
            bk, bv = _read_block(s, 0, slot // B)
            assert torch.equal(k[r, :, c], bk[:, slot % B]) and torch.equal(v[r, :, c], bv[:, slot % B])


def test_copy_on_write_of_a_sealed_block_is_exact():
    s = _storage(bits=4)
    s.reset_block(2)
    _fill(s, 2, seed=1)
    s.seal_block(2)
    original = [_read_block(s, layer, 2) for layer in range(s.num_layers)]
    s.reset_block(5)
    s.copy_block(2, 5)
    assert s.is_sealed(5) and s.slot_of[5] == -1
    for layer in range(s.num_layers):
        assert all(torch.equal(a, b) for a, b in zip(_read_block(s, layer, 5), original[layer]))
    s.reset_block(5)  # the copy is handed out anew and rewritten: the original does not change
    _fill(s, 5, seed=2)
    for layer in range(s.num_layers):
        assert all(torch.equal(a, b) for a, b in zip(_read_block(s, layer, 2), original[layer]))


def test_copy_on_write_of_a_staged_block_is_exact():
    s = _storage(bits=2)
    s.reset_block(1)
    kv = _fill(s, 1, seed=3)
    s.reset_block(4)
    s.copy_block(1, 4)
    assert not s.is_sealed(4)
    for layer in range(s.num_layers):
        assert all(torch.equal(a, b) for a, b in zip(_read_block(s, layer, 4), kv[layer]))


def test_cache_copy_on_write_of_a_shared_block(tiny_model):
    """Two sequences share a prompt's blocks; one crops into the shared tail block and writes: it gets a copy, the
    other's tokens and logits stay those of a cache that never shared."""
    model, tokenizer = tiny_model
    prompt = _prompts(tokenizer)[3]  # 64 tokens
    kv = {"kind": "int4", "residual": 20}
    cache = paged_cache_for(model, KVSpec.from_node(kv), num_blocks=64, block_size=8)
    (a,), (first,), _ = _generate(model, cache, [prompt], 1)
    b = cache.new_sequence(prompt + [7, 8])  # reuses 8 blocks, some sealed by a
    assert b.cached_tokens == 64 and b.sealed == a.sealed > 0
    shared = b.blocks[-1]
    cache.crop_sequence(b, 60)  # inside the residual window, inside the last shared block
    with torch.inference_mode():
        positions, mask = cache.bind([b], [[5, 6]])
        model(input_ids=torch.tensor([[5, 6]]), position_ids=positions, attention_mask=mask, cache=cache)
        cache.commit()
    assert b.blocks[-1] != shared and a.blocks[-1] == shared and cache.pool.stats.cow_copies == 1
    # a continues exactly as a cache that held only a
    alone = paged_cache_for(model, KVSpec.from_node(kv), num_blocks=64, block_size=8)
    _, ref_tokens, ref_logits = _generate(model, alone, [prompt], 6, reuse_prefix=False)
    tokens, logits = _continue(model, cache, a, first[0], 5)
    assert tokens == ref_tokens[0][1:] and torch.equal(logits, ref_logits)


@torch.inference_mode()
def _continue(model, cache, seq, token, steps):
    """Feed `token` then `steps - 1` greedy tokens to seq; (the tokens generated, the last logits)."""
    tokens, logits = [], None
    for _ in range(steps):
        positions, mask = cache.bind([seq], [[token]])
        logits = model(input_ids=torch.tensor([[token]]), position_ids=positions, attention_mask=mask,
                       cache=cache).logits[:, -1]
        cache.commit()
        token = int(logits.argmax())
        tokens.append(token)
    return tokens, logits


# ---- crop ------------------------------------------------------------------------------------------------------------

def test_crop_inside_the_residual_window_works_and_into_a_sealed_block_raises(tiny_model):
    model, tokenizer = tiny_model
    prompt = _prompts(tokenizer)[3][:50]
    cache = paged_cache_for(model, KVSpec.from_node({"kind": "int4", "residual": 12}), num_blocks=32, block_size=8)
    (seq,), _, _ = _generate(model, cache, [prompt], 1)
    assert seq.sealed == (50 - 12) // 8 == 4  # tokens 0..31
    with torch.inference_mode():  # a speculative verify of 4 tokens
        positions, mask = cache.bind([seq], [[11, 12, 13, 14]])
        model(input_ids=torch.tensor([[11, 12, 13, 14]]), position_ids=positions, attention_mask=mask, cache=cache)
        cache.commit()
    assert seq.sealed == (54 - 12) // 8 == 5  # tokens 0..39
    cache.crop_sequence(seq, 51)  # 3 rejected: inside the full-precision part
    assert seq.length == 51 and seq.tokens == prompt + [11]
    with pytest.raises(ValueError, match="sealed"):
        cache.crop_sequence(seq, 39)
    assert seq.length == 51
    cache.crop_sequence(seq, 40)  # the sealed part's end: allowed, and appending works
    _continue(model, cache, seq, 3, 2)
    assert seq.length == 42


def test_crop_then_append_equals_a_fresh_cache_when_nothing_new_seals(tiny_model):
    model, tokenizer = tiny_model
    prompt = _prompts(tokenizer)[0]  # 40 tokens
    kv = {"kind": "int8", "residual": 16}
    cache = paged_cache_for(model, KVSpec.from_node(kv), num_blocks=32, block_size=8)
    (seq,), (first,), _ = _generate(model, cache, [prompt], 1)  # 40 tokens: blocks 0..2 sealed
    with torch.inference_mode():
        positions, mask = cache.bind([seq], [[9, 10]])
        model(input_ids=torch.tensor([[9, 10]]), position_ids=positions, attention_mask=mask, cache=cache)
        cache.commit()
    assert seq.sealed == 3
    cache.crop_sequence(seq, 40)
    tokens, logits = _continue(model, cache, seq, first[0], 4)
    fresh = paged_cache_for(model, KVSpec.from_node(kv), num_blocks=32, block_size=8)
    _, ref_tokens, ref_logits = _generate(model, fresh, [prompt], 5)
    assert tokens == ref_tokens[0][1:] and torch.equal(logits, ref_logits)


# ---- bytes -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,dim,group,block", [(8, 16, 32, 8), (4, 64, 32, 16), (2, 64, 16, 16), (4, 128, 128, 4)])
def test_bytes_formula_equals_the_real_tensor_bytes(bits, dim, group, block):
    s = _storage(bits=bits, dim=dim, group=group, block_size=block, num_blocks=10, slots=3, layers=3, heads=2)
    assert s.nbytes == s.tensor_bytes
    vg = min(group, dim)
    per_block = 3 * 2 * (2 * block * dim * bits // 8 + 2 * dim * 2 + 2 * block * (dim // vg) * 2)
    per_slot = 3 * 2 * 2 * block * dim * 4
    assert s.nbytes == 10 * per_block + 3 * per_slot
    assert QuantizedBlockStorage.bytes_per_block(3, block, 2, dim, bits, group) == per_block


def test_plan_pool_fits_the_budget_and_the_staging_need(tiny_model):
    model, _ = tiny_model
    plan = plan_pool(model, KVSpec.from_node("int4"), 1_000_000, block_size=8, max_sequences=2, prefill_tokens=64)
    assert plan.staging_slots == staging_slots_for(8, 128, 2, 1, 64) == 2 * (17 + 1) + 8
    storage = paged_storage_for(model, KVSpec.from_node("int4"), plan.num_blocks, 8, staging_slots=plan.staging_slots)
    assert storage.nbytes == plan.nbytes <= 1_000_000
    fp_blocks = 1_000_000 // PagedKVCache.bytes_per_block(model, 8)
    assert plan.num_blocks > fp_blocks  # more tokens fit than in fp blocks
    with pytest.raises(InputError, match="budget"):
        plan_pool(model, KVSpec.from_node("int4"), 10_000, block_size=8, max_sequences=8)


# ---- staging ---------------------------------------------------------------------------------------------------------

def test_running_out_of_staging_raises_out_of_blocks(tiny_model):
    model, tokenizer = tiny_model
    cache = PagedKVCache(model, 32, 8, storage=paged_storage_for(model, KVSpec("int8"), 32, 8, staging_slots=4))
    with pytest.raises(OutOfBlocks, match="staging"):
        _generate(model, cache, [_prompts(tokenizer)[3]], 1)  # a 64-token prefill stages 8 blocks at once


def test_attached_storage_takes_staging_back_from_idle_blocks(tiny_model):
    """Many requests in turn through 6 staging slots: finished ones leave free and cached unsealed blocks behind,
    whose slots the next requests take (evicting cached ones); outputs equal the fp cache's (nothing sealed)."""
    model, tokenizer = tiny_model
    prompts = [p[:20] for p in _prompts(tokenizer)]
    cache = paged_cache_for(model, KVSpec.from_node({"kind": "int4", "residual": 64}), 48, 8, staging_slots=6)
    fp = PagedKVCache(model, 48, 8)
    for prompt in prompts:
        assert cache.storage.staging_available == 6  # every slot is free or held by an idle block
        (seq,), tokens, _ = _generate(model, cache, [prompt], 8)
        (ref,), ref_tokens, _ = _generate(model, fp, [prompt], 8)
        assert tokens == ref_tokens
        cache.free(seq)
        fp.free(ref)
        cache.pool.check()
    assert cache.pool.stats.evictions > 0
    assert cache.pool.used == 0


def test_without_prefix_caching_freed_blocks_give_their_staging_back(tiny_model):
    model, tokenizer = tiny_model
    cache = paged_cache_for(model, KVSpec.from_node("int8"), 48, 8, prefix_cache=False, staging_slots=5)
    for prompt in _prompts(tokenizer):
        (seq,), _, _ = _generate(model, cache, [prompt[:30]], 6)
        cache.free(seq)
    assert cache.pool.stats.evictions == 0 and cache.storage.staging_available == 5


# ---- factory ---------------------------------------------------------------------------------------------------------

def test_factory_picks_the_storage_from_the_kv_config(tiny_model):
    model, _ = tiny_model
    assert isinstance(paged_storage_for(model, KVSpec.from_node(None), 8, 8), FPBlockStorage)
    assert isinstance(paged_storage_for(model, KVSpec.from_node("fp"), 8, 8), FPBlockStorage)
    s = paged_storage_for(model, KVSpec.from_node({"kind": "int2", "residual": 32, "group_size": 8}), 40, 8)
    assert (s.bits, s.residual_tokens, s.value_group) == (2, 32, 8)
    assert s.staging_slots == min(40, staging_slots_for(8, 32, 8, 1, 2048))
    with pytest.raises(InputError, match="hierarchical"):
        paged_storage_for(model, KVSpec.from_node({"kind": "int8", "hierarchical": True}), 8, 8)
    with pytest.raises(InputError):
        paged_storage_for(model, KVSpec.from_node("int3"), 8, 8)


# ---- the real model --------------------------------------------------------------------------------------------------

@pytest.mark.real_model
def test_int8_paged_generation_agrees_with_fp_smollm2(smollm2):
    from toolkit.data import load_text

    model, tokenizer = smollm2.model, smollm2.tokenizer
    text = "\n\n".join(load_text("pydoc", "evaluation")["text"])
    prompts = [tokenizer(text[i * 3000:(i + 1) * 3000]).input_ids[:n] for i, n in enumerate((300, 180, 240))]
    steps = 48
    _, fp_tokens, _ = _generate(model, PagedKVCache(model, 200, 16), prompts, steps)
    cache = paged_cache_for(model, KVSpec.from_node({"kind": "int8", "residual": 32, "group_size": 32}), 200, 16)
    seqs, tokens, _ = _generate(model, cache, prompts, steps)
    assert all(s.sealed >= (s.length - 32) // 16 - 1 > 0 for s in seqs)
    same = sum(a == b for x, y in zip(tokens, fp_tokens) for a, b in zip(x, y))
    agreement = same / (len(prompts) * steps)
    print(f"SmolLM2 paged int8 KV (block 16, residual 32, value group 32) greedy agreement with fp paged over "
          f"{len(prompts)} x {steps} tokens: {agreement:.3f}")
    assert agreement >= 0.9


def test_a_storage_built_in_inference_mode_is_sealed_and_reset_outside_it(tiny_model):
    model, tokenizer = tiny_model
    with torch.inference_mode():  # as a server builds it; bind/commit then run outside (seal, reset, copy)
        cache = paged_cache_for(model, KVSpec.from_node({"kind": "int4", "residual": 8}), 32, 8)
    prompt = _prompts(tokenizer)[0]
    for tokens in (prompt, prompt[:20] + [9, 9]):  # the second reuses 2 sealed blocks and writes into fresh ones
        seq = cache.new_sequence(tokens)
        for new in ([tokens[seq.length:]], [[5]], [[6]]):
            positions, mask = cache.bind([seq], new)
            with torch.inference_mode():
                model(input_ids=torch.tensor(new), position_ids=positions, attention_mask=mask, cache=cache)
            cache.commit()
        cache.free(seq)
    assert seq.cached_tokens == 16 and cache.storage.is_sealed(cache.pool.lookup(0, tuple(prompt[:8])))


@pytest.mark.parametrize("bits,dim,group", [(2, 16, 32), (4, 16, 8), (4, 64, 32), (2, 64, 64)])
def test_the_fused_kernel_reads_sealed_blocks_as_the_torch_ops_do(bits, dim, group):
    """The paged read through toolkit/kv/native.py (a gather of scattered slots) equals the torch ops bit for bit."""
    from toolkit.kv import native

    if native.kernel() is None:
        pytest.skip("the KV kernel is not built here (no C compiler, or SPECQUANT_NO_KERNELS is set)")
    reads = []
    for fused in (True, False):
        s = QuantizedBlockStorage(2, 8, 8, 3, dim, torch.float32, bits=bits, residual_tokens=0, staging_slots=8,
                                  value_group=group, fused=fused)
        assert s.fused == fused
        for block in range(5):
            s.reset_block(block)
            _fill(s, block, seed=block)
        for block in (1, 2, 4):
            s.seal_block(block)
        B = s.block_size
        index = torch.tensor([[4 * B + 1, 1 * B, 0, 2 * B + 5, 4 * B + 7], [2 * B + 7, 3 * B, 1 * B + 3, 4 * B, 0]])
        reads.append([s.gather(layer, index) for layer in range(2)])
    for (fk, fv), (tk, tv) in zip(*reads):
        assert torch.equal(fk, tk) and torch.equal(fv, tv)
