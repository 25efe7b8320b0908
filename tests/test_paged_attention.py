"""Bucketed attention over the paged cache (toolkit.kv.paged.attention): the bucketing is optimal, and a batch of rows
of very different lengths gives the same logits read bucket by bucket as padded to the longest, and as each row
alone, in decode and verify calls, for Llama and Gemma 3 (sliding layers), fp and quantized blocks."""

import itertools
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from toolkit.engine.generate import paged_forward
from toolkit.kv import KVSpec
from toolkit.kv.paged import PagedKVCache
from toolkit.kv.paged.attention import PAGED_ATTENTION, bucket_rows, use_paged_attention
from toolkit.kv.paged.quantized_storage import paged_cache_for


def _cost(widths, buckets, overhead):
    return sum(len(b) * max(widths[r] for r in b) + overhead for b in buckets)


def _best_cost(widths, overhead):
    """Brute force: every cut of the sorted rows into consecutive groups."""
    order = sorted(range(len(widths)), key=widths.__getitem__)
    best = float("inf")
    for cuts in itertools.product([False, True], repeat=len(order) - 1):
        groups, current = [], [order[0]]
        for row, cut in zip(order[1:], cuts):
            if cut:
                groups.append(current)
                current = []
            current.append(row)
        groups.append(current)
        best = min(best, _cost(widths, groups, overhead))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_bucket_rows_is_an_optimal_partition(seed):
    rng = random.Random(seed)
    widths = [rng.choice([rng.randint(1, 40), rng.randint(100, 700)]) for _ in range(rng.randint(1, 9))]
    overhead = rng.choice([0, 16, 192])
    buckets = bucket_rows(widths, overhead)
    assert sorted(r for b in buckets for r in b) == list(range(len(widths)))
    assert _cost(widths, buckets, overhead) == _best_cost(widths, overhead)


def test_bucket_rows_keeps_similar_rows_together_and_splits_spread_ones():
    assert bucket_rows([300, 301, 299, 300], 192) == [[2, 0, 3, 1]]
    assert bucket_rows([20, 600, 30, 610], 192) == [[0, 2], [1, 3]]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def paged_model(request, tiny_llama_dir, tiny_gemma3_dir):
    """A fresh copy (the session's tiny models stay on plain sdpa), switched to the bucketed attention."""
    path = tiny_llama_dir if request.param == "llama" else tiny_gemma3_dir
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return use_paged_attention(model)


def _prefilled(model, cache, lengths, seed=0):
    rng = random.Random(seed)
    vocab = model.config.get_text_config().vocab_size
    seqs = []
    for n in lengths:
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        seq = cache.new_sequence(ids, reuse_prefix=False)
        paged_forward(model, cache, [seq], [ids])
        seqs.append(seq)
    return seqs


def _step(model, cache, seqs, tokens, bucketed):
    """One batched call, then cropped back so the next call sees the same state."""
    cache.bucketed = bucketed
    lengths = [s.length for s in seqs]
    logits = paged_forward(model, cache, seqs, tokens, keep=len(tokens[0]))
    for seq, length in zip(seqs, lengths):
        cache.crop_sequence(seq, length)
    return logits


LENGTHS = (5, 300, 12, 250, 40, 260, 7)


@pytest.mark.parametrize("kv", ["fp", "int8"])
@pytest.mark.parametrize("q", [1, 3])
@torch.inference_mode()
def test_bucketed_equals_padded_and_each_row_alone(paged_model, kv, q):
    model = paged_model
    assert model.config._attn_implementation == PAGED_ATTENTION
    if kv == "fp":
        cache = PagedKVCache(model, num_blocks=160, block_size=8, prefix_cache=False)
    else:  # a residual window shorter than the rows: sealed (quantized) blocks are read too
        cache = paged_cache_for(model, KVSpec.from_node({"kind": "int8", "group_size": 8, "residual": 16}), 160, 8,
                                prefix_cache=False, max_sequences=len(LENGTHS), step_tokens=q, prefill_tokens=300)
    assert cache.bucketed
    seqs = _prefilled(model, cache, LENGTHS)
    tokens = [[11 + r + j for j in range(q)] for r in range(len(seqs))]

    cache.bind(seqs, tokens)
    assert cache.buckets is not None and len(cache.buckets) > 1  # the spread lengths are really cut
    for seq in seqs:
        cache.crop_sequence(seq, seq.length)
    cache.batch, cache.buckets = [], None

    bucketed = _step(model, cache, seqs, tokens, True)
    padded = _step(model, cache, seqs, tokens, False)
    alone = torch.stack([_step(model, cache, [s], [t], False)[0] for s, t in zip(seqs, tokens)])
    torch.testing.assert_close(bucketed, padded, rtol=0, atol=1e-4)
    torch.testing.assert_close(bucketed, alone, rtol=0, atol=1e-4)
    for seq in seqs:
        cache.free(seq)
    assert cache.pool.used == 0


def test_a_model_left_on_sdpa_pads_every_row(tiny_llama_dir):
    # a fresh model: the server's tests switch the session's shared tiny models to the paged attention
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    assert model.config._attn_implementation == "sdpa"
    assert not PagedKVCache(model, num_blocks=8, block_size=8).bucketed
