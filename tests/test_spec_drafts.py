"""Speculative decoding's drafts (toolkit/spec): prompt lookup (latest match, length scaled by the match, the agreement
rule, its options reaching generate, bench and serve), the draft-length policy, the self-draft (shared modules,
quantized and subset heads, a quantized target's codes, drafting in the target's own KV cache), clear errors."""

import pytest
import torch

from tests.test_spec import _ids, _prompts
from toolkit.engine.generate import generate
from toolkit.errors import InputError
from toolkit.kv import KVSpec
from toolkit.spec.build import build_draft
from toolkit.spec.decode import DraftLength, speculative_generate
from toolkit.spec.draft_head import quantize_draft_head
from toolkit.spec.drafts import LookupDraft, ModelDraft
from toolkit.spec.self_draft import build_self_draft, describe

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_lookup_proposes_what_followed_the_latest_match():
    draft = LookupDraft(ngram_max=2, ngram_min=1)
    assert draft.lookup([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 3) == [4, 5, 1]  # latest "1 2" wins
    assert draft.lookup([1, 2, 3, 4], 3) == []
    assert draft.lookup([7, 8, 7], 5) == [8, 7]  # never past the context's end
    with pytest.raises(InputError):
        LookupDraft(ngram_max=1, ngram_min=2)


def test_lookup_scaled_by_match_proposes_fewer_tokens_after_a_shorter_match():
    context = [5, 6, 7, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    plain, scaled = LookupDraft(ngram_max=3), LookupDraft(ngram_max=3, scale_by_match=True)
    # "... 2 3 4" matches 3 tokens: the full k either way
    assert scaled.lookup(context + [2, 3, 4], 9) == plain.lookup(context + [2, 3, 4], 9) == context[7:16]
    # "... 0 3 4" matches 2 tokens: k * 2 / 3 rounded (6 of 9, 5 of 8: 16 / 3 = 5.33)
    assert scaled.lookup(context + [0, 3, 4], 9) == context[7:13]
    assert scaled.lookup(context + [0, 3, 4], 8) == context[7:12]
    # "... 0 0 4" matches 1 token: a third of k, and never fewer than one token
    assert scaled.lookup(context + [0, 0, 4], 9) == context[7:10]
    assert scaled.lookup(context + [0, 0, 4], 1) == [8]
    assert plain.lookup(context + [0, 0, 4], 9) == context[7:16]
    assert scaled.lookup(context + [0, 0, 99], 9) == []


def test_lookup_by_agreement_spends_k_only_where_the_tail_was_followed_the_same_way_before():
    draft = LookupDraft(ngram_max=3, scale_by_match=True, agree_tokens=2, doubt_k=2)
    once = [40, 41, 42, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    # "40 41 42" occurs once before the tail: half of k * 3 / 3 (8 of 16)
    assert draft.lookup(once + [40, 41, 42], 16) == once[3:11]
    # ... and after a 1-token match, half of k / 3 rounded (3 of 16)
    assert draft.lookup(once + [0, 0, 42], 16) == once[3:6]
    # occurs twice, followed both times by "1 2": the passage repeats again, propose the full k
    twice = once + [40, 41, 42, 1, 2, 77]
    assert draft.agreement(twice + [40, 41, 42], len(once) + 3, 3) == 1
    assert draft.lookup(twice + [40, 41, 42], 16) == [1, 2, 77, 40, 41, 42]  # all of the context after the match
    # occurs twice, followed by "1 2" and then by "9 9": a guess among several, at most doubt_k
    differ = once + [40, 41, 42, 9, 9, 77, 78]
    assert draft.agreement(differ + [40, 41, 42], len(once) + 3, 3) == -1
    assert draft.lookup(differ + [40, 41, 42], 16) == [9, 9]
    # the rule off: the length by match alone, as before
    assert LookupDraft(ngram_max=3, scale_by_match=True).lookup(differ + [40, 41, 42], 16) == [9, 9, 77, 78, 40, 41,
                                                                                               42]
    with pytest.raises(InputError, match="doubt_k"):
        LookupDraft(agree_tokens=4, doubt_k=0)


def test_the_lookup_options_reach_the_draft_in_generate_bench_and_serve():
    from omegaconf import OmegaConf

    from toolkit.serve.speculation import serve_spec
    from toolkit.spec.build import build_draft

    node = OmegaConf.create({"kind": "lookup", "k": 6, "ngram_max": 4, "ngram_min": 2, "scale_by_match": True,
                             "agree_tokens": 3, "doubt_k": 1})
    for draft in (build_draft(node, None, None), serve_spec(node).draft):
        assert (draft.ngram_max, draft.ngram_min, draft.scale_by_match, draft.agree_tokens, draft.doubt_k) == \
            (4, 2, True, 3, 1)
    default = build_draft("lookup", None, None)  # the conf defaults, for a bare kind name too
    assert (default.scale_by_match, default.agree_tokens, default.doubt_k) == (True, 4, 2)


def test_adaptive_length_grows_on_full_acceptance_and_shrinks_on_rejection():
    length = DraftLength(k=3, adaptive=True, k_min=2, k_max=5)
    assert [length.next(k, full) for k, full in [(3, True), (5, True), (3, False), (2, False)]] == [4, 5, 2, 2]
    assert DraftLength(k=3).next(3, True) == 3
    with pytest.raises(InputError):
        DraftLength(k=9, adaptive=True, k_max=8)


def test_the_self_draft_shares_the_targets_modules_and_leaves_it_untouched(llama_and_gemma):
    llama, _, _ = llama_and_gemma
    before = [type(m).__name__ for m in llama.modules()]
    draft = build_self_draft(llama, layers=1, bits=4, group_size=32)
    assert draft.get_input_embeddings() is llama.get_input_embeddings()
    assert draft.get_output_embeddings() is llama.get_output_embeddings() and draft.model.norm is llama.model.norm
    assert len(draft.model.layers) == 1 and len(llama.model.layers) == 2
    assert "QuantLinear" in {type(m).__name__ for m in draft.modules()}
    assert [type(m).__name__ for m in llama.modules()] == before
    shared = build_self_draft(llama, bits=None)
    assert all(a is b for a, b in zip(shared.model.layers, llama.model.layers))
    with pytest.raises(InputError, match="layers"):
        build_self_draft(llama, layers=3)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_drafts_quantized_head_is_its_own_and_close_to_the_float_one(llama_and_gemma, bits):
    from toolkit.quant.qlinear import QuantLinear

    llama, _, _ = llama_and_gemma
    head = llama.get_output_embeddings()
    draft = build_self_draft(llama, layers=1, bits=4, group_size=32)
    quantize_draft_head(draft, bits, 32)
    assert isinstance(draft.lm_head, QuantLinear) and draft.lm_head.bits == bits
    assert llama.get_output_embeddings() is head and isinstance(head, torch.nn.Linear)  # the target keeps its own
    assert describe(draft).endswith(f"int{bits} head")
    hidden = torch.randn(3, head.in_features)
    with torch.no_grad():
        want, got = head(hidden), draft.lm_head(hidden)
    assert ((got - want).norm() / want.norm()).item() < (0.2 if bits == 4 else 0.02)
    with pytest.raises(InputError, match="head_bits"):
        quantize_draft_head(draft, 3, 32)
    with pytest.raises(InputError, match="head_group_size"):
        quantize_draft_head(build_self_draft(llama, layers=1), 4, 48)


def test_frequent_tokens_rank_the_offline_text_deterministically(tiny_tokenizer):
    from toolkit.spec.draft_vocab import frequent_tokens, token_ranking

    vocab = len(tiny_tokenizer)
    ranking = token_ranking(tiny_tokenizer)
    assert ranking[:len(tiny_tokenizer.all_special_ids)] == sorted(tiny_tokenizer.all_special_ids)
    assert len(set(ranking)) == len(ranking) and all(0 <= t < vocab for t in ranking)
    ids = frequent_tokens(tiny_tokenizer, 128, vocab)
    assert ids.tolist() == sorted(ranking[:128]) and len(ids) % 64 == 0
    assert frequent_tokens(tiny_tokenizer, 128, vocab).equal(ids)  # a function of the tokenizer alone
    # the most frequent ids of the text are in: the space-led "the" of prose, the newline of code
    for text in (" the", "\n"):
        assert all(t in ids for t in tiny_tokenizer(text).input_ids)
    assert frequent_tokens(tiny_tokenizer, vocab, vocab) is None
    with pytest.raises(InputError, match="head_vocab"):
        frequent_tokens(tiny_tokenizer, 0, vocab)


def test_a_subset_head_scores_its_tokens_and_the_contexts_as_the_full_heads_do(llama_and_gemma):
    from toolkit.spec.draft_vocab import SubsetHead

    llama, _, tok = llama_and_gemma
    full = build_self_draft(llama, layers=1, bits=4, group_size=32)
    quantize_draft_head(full, 8, 32)
    draft = build_self_draft(llama, layers=1, bits=4, group_size=32)
    ids = torch.arange(0, 128, 2)
    quantize_draft_head(draft, 8, 32, vocab=ids)
    head = draft.lm_head
    assert isinstance(head, SubsetHead) and head.vocab_ids.equal(ids)
    assert describe(draft).endswith("int8 head over 64 frequent tokens + the context's")
    hidden = torch.randn(3, 64)
    float_head = llama.get_output_embeddings()
    with torch.no_grad():
        # the frequent rows are the full quantized head's rows (the same per-channel codes), bit for bit
        assert torch.equal(head(hidden), full.lm_head(hidden)[:, ids])
        head.include([5, 6, 300, 5, 10_000])  # 6 is in already, 10_000 is no row of this head
        assert head.vocab_ids.tolist() == ids.tolist() + [5, 300]
        got = head(hidden)
        assert torch.equal(got[:, :64], full.lm_head(hidden)[:, ids])
        assert torch.allclose(got[:, 64:], float_head(hidden)[:, [5, 300]], atol=1e-5)  # the float rows
        head.reset()
        assert head.vocab_ids.equal(ids) and head(hidden).shape == (3, 64)
    with pytest.raises(InputError, match="head_vocab"):
        build_draft({"kind": "self", "bits": 4, "group_size": 32, "head_bits": None, "head_vocab": 64}, llama, tok)
    # proposals are token ids, not the subset's column numbers: a draft of the target's own layers whose subset
    # holds the tokens the target emits is mostly kept
    prompts = _prompts(4)
    emitted = sorted({t for ids in _ids(generate(llama, tok, prompts, 24, stop_tokens=set())) for t in ids})
    emitted += [t for t in range(512) if t not in emitted][:-len(emitted) % 16 or 0]  # whole tiles of 16 rows
    close = build_self_draft(llama, bits=None)
    quantize_draft_head(close, 8, 32, vocab=torch.tensor(sorted(emitted)))
    out = speculative_generate(llama, tok, prompts, 24, ModelDraft(close), DraftLength(4), stop_tokens=set())
    assert out.stats.acceptance_rate > 0.7, out.stats.summary()


def test_self_draft_of_a_quantized_target_requantizes_wider_codes_and_keeps_narrower_ones(llama_and_gemma):
    import copy

    from toolkit.quant.model_quant import QuantRecipe, quantize_model, swap_quantized_modules
    from toolkit.quant.qlinear import QuantLinear

    llama, _, tok = llama_and_gemma
    prompts = _prompts(4)
    for bits in (8, 4):
        target = copy.deepcopy(llama)
        swap_quantized_modules(target.model.layers, quantize_model(target.model.layers, QuantRecipe(
            method="rtn", bits=bits, group_size=32, skip=()), progress=False), QuantLinear.from_quantized)
        draft = build_self_draft(target, bits=4, group_size=32)
        codes = {m.bits for m in draft.model.layers.modules() if isinstance(m, QuantLinear)}
        assert codes == {4}  # int8 codes went back to float and down to int4; int4 codes stayed
        reference = _ids(generate(target, tok, prompts, 12, stop_tokens=set()))
        got = _ids(speculative_generate(target, tok, prompts, 12, ModelDraft(draft), DraftLength(k=3),
                                        stop_tokens=set()))
        assert got == reference


def test_a_shared_kv_draft_runs_in_the_targets_full_precision_cache(llama_and_gemma):
    """spec.share_kv with a full-precision target cache: the draft drafts in the target's cache itself, nothing
    copied. Every round it starts at the target's length and leaves the cache as it found it (length and the
    verified tokens' keys and values; its own drafted tokens dropped), and the output is the target's own. A batch,
    or share_kv off, keeps the draft's own cache."""
    llama, _, tok = llama_and_gemma
    spec = {"kind": "self", "bits": 4, "group_size": 32, "share_kv": True}
    draft = build_draft(spec, llama, tok)
    prompt = _prompts(2)[1]
    rounds, propose = [], draft.propose

    def checked_propose(contexts, k, active=None):
        cache = draft.state.cache
        length = cache.length
        keys = [layer.key_buffer[:, :, :length].clone() for layer in cache.layers]
        values = [layer.value_buffer[:, :, :length].clone() for layer in cache.layers]
        out = propose(contexts, k, active)
        assert cache.length == length == len(contexts[0]) - 1  # every emitted token but the pending one
        for layer, k0, v0 in zip(cache.layers, keys, values):
            assert torch.equal(layer.key_buffer[:, :, :length], k0) and torch.equal(layer.value_buffer[:, :, :length], v0)
        rounds.append(len(out[0][0]))
        return out

    draft.propose = checked_propose
    out = speculative_generate(llama, tok, [prompt], 16, draft, DraftLength(3), stop_tokens=set())
    assert draft.in_place and draft.target is not None and draft.state.cache is draft.target.cache
    assert out.sequences[0].token_ids == generate(llama, tok, [prompt], 16, stop_tokens=set()).sequences[0].token_ids
    assert out.stats.rounds > 1 and len(rounds) == out.stats.rounds and out.stats.accepted > 0
    del draft.propose
    own = build_draft({**spec, "share_kv": False}, llama, tok)
    speculative_generate(llama, tok, [prompt], 4, own, DraftLength(3), stop_tokens=set())
    assert own.target is None and not own.in_place
    speculative_generate(llama, tok, _prompts(2), 4, draft, DraftLength(3), stop_tokens=set())
    assert draft.target is None and not draft.in_place  # two sequences: the draft keeps its own cache


@pytest.mark.parametrize("bits,group", [(8, 8), (4, 8), (4, 16)])  # G = 16: keys wait staged, groups form apart
def test_a_shared_kv_draft_reads_a_quantized_target_cache_as_the_targets_attention_does(llama_and_gemma, bits, group):
    """With kv=int8/int4 the target's cache is quantized: the shared draft's full-precision cache holds, up to the
    last sync, exactly what the target's attention reads (dequantized groups, the full-precision window, sinks).
    (Greedy identity on quantized caches, in tests/test_spec.py: test_quantized_kv_caches_roll_back_exactly, and with
    a window this short, where flushes fall inside verify passes,
    test_greedy_identity_holds_when_a_flush_falls_inside_a_verify_pass.)"""
    llama, _, tok = llama_and_gemma
    spec = {"kind": "self", "bits": 4, "group_size": 32, "share_kv": True}
    # a short full-precision window and small groups: most of these short prompts' tokens are read back quantized
    from omegaconf import OmegaConf

    kind = OmegaConf.create({"kind": f"int{bits}", "bits": bits, "group_size": group, "residual": 8})
    for prompt in _prompts(3):
        draft = build_draft(spec, llama, tok)
        synced, sync = [], draft._sync

        def checked_sync():  # right after each sync: the draft's cache against the target's current reading
            sync()
            n = draft.synced
            for mine, theirs in zip(draft.state.cache.layers, draft.target.cache.layers):
                keys, values = theirs.attention_view()
                assert torch.equal(mine.key_buffer[:, :, :n], keys[:, :, :n])
                assert torch.equal(mine.value_buffer[:, :, :n], values[:, :, :n])
            synced.append((n, draft.target.cache.layers[0].quantized))

        draft._sync = checked_sync
        out = speculative_generate(llama, tok, [prompt], 24, draft, DraftLength(3), stop_tokens=set(),
                                   kv=KVSpec.from_node(kind))
        assert out.stats.rounds > 1 and len(synced) == out.stats.rounds
        assert type(draft.target.cache).__name__ == "QuantizedKVCache"
        n, quantized = synced[-1]
        assert len(tok(prompt).input_ids) < n and quantized > n // 2  # most of what the draft read was quantized


def test_draft_activation_bits_other_than_8_are_a_clear_error(llama_and_gemma):
    llama, _, tok = llama_and_gemma
    with pytest.raises(InputError, match="act_bits"):
        build_draft({"kind": "self", "bits": 4, "group_size": 32, "act_bits": 4}, llama, tok)
