"""Speculative decoding (toolkit/spec): greedy identity with the target alone for every draft, batch and cache kind;
the accept/resample rule against the exact distribution; rollback; the draft-length policy; clear errors."""


import pytest
import torch

from toolkit.engine.generate import generate
from toolkit.engine.sampling import SamplingParams, probabilities
from toolkit.errors import InputError
from toolkit.kv import KVSpec
from toolkit.spec.build import build_draft
from toolkit.spec.decode import DraftLength, speculative_generate
from toolkit.spec.drafts import LookupDraft, ModelDraft
from toolkit.spec.ragged import RaggedBatch
from toolkit.spec.draft_head import quantize_draft_head
from toolkit.spec.self_draft import build_self_draft, describe
from toolkit.spec.verify import greedy_verify, rejection_verify, residual


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one thread, and other jobs share the cores: spinning threads only slow all down."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _prompts(n: int) -> list[str]:
    """Varied prompts from offline text: some repeat themselves (lookup finds matches), some do not."""
    import pydoc_data.topics

    texts = [t for t in pydoc_data.topics.topics.values() if len(t) > 400]
    out = []
    for i in range(n):
        text = texts[(7 * i) % len(texts)]
        start = (37 * i) % 200
        chunk = text[start:start + 60 + 13 * (i % 5)]
        out.append(chunk + " " + chunk[:25] if i % 2 else chunk)
    return out


def _drafts(model, tokenizer, other):
    return {
        "lookup": lambda: LookupDraft(3, 1),
        "lookup-scaled": lambda: LookupDraft(3, 1, scale_by_match=True),
        "lookup-agree": lambda: LookupDraft(3, 1, scale_by_match=True, agree_tokens=4, doubt_k=2),  # the default
        "self-int4-1layer": lambda: ModelDraft(build_self_draft(model, layers=1, bits=4, group_size=32)),
        "self-all-layers": lambda: ModelDraft(build_self_draft(model, bits=None)),
        "self-int4-head": lambda: ModelDraft(_with_int4_head(build_self_draft(model, layers=1, bits=4, group_size=32))),
        # the spec=self defaults: the target's keys and values (one sequence; a batch keeps its own), int8 head
        "self-shared-kv": lambda: build_draft({"kind": "self", "bits": 4, "group_size": 32, "share_kv": True,
                                               "act_bits": 8, "head_bits": 8, "head_group_size": 32}, model, tokenizer),
        # spec.head_vocab: the head over the 64 most frequent tokens of the offline text + the context's own
        "self-subset-head": lambda: build_draft({"kind": "self", "bits": 4, "group_size": 32, "share_kv": True,
                                                 "act_bits": 8, "head_bits": 8, "head_group_size": 32,
                                                 "head_vocab": 64}, model, tokenizer),
        "other-model": lambda: ModelDraft(other, target_tokenizer=tokenizer, draft_tokenizer=tokenizer,
                                          target_vocab=model.get_output_embeddings().weight.shape[0]),
    }


def _with_int4_head(draft):
    quantize_draft_head(draft, 4, 32)
    return draft


@pytest.fixture(scope="module")
def llama_and_gemma(tiny_llama_dir, tiny_gemma3_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llama = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    gemma = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32).eval()
    return llama, gemma, AutoTokenizer.from_pretrained(tiny_llama_dir)


def _ids(result):
    return [s.token_ids for s in result.sequences]


@pytest.mark.parametrize("draft_name", ["lookup", "lookup-scaled", "self-int4-1layer", "self-all-layers", "other-model",
                                        "self-int4-head", "self-shared-kv", "self-subset-head"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_output_is_the_target_alone_one_sequence_at_a_time(llama_and_gemma, arch, draft_name):
    llama, gemma, tok = llama_and_gemma
    model, other = (llama, gemma) if arch == "llama" else (gemma, llama)
    prompts = _prompts(8)
    reference = _ids(generate(model, tok, prompts, 16, stop_tokens=set()))
    make = _drafts(model, tok, other)[draft_name]
    for i, prompt in enumerate(prompts):
        length = DraftLength(k=1 + i % 5, adaptive=i % 2 == 1, k_min=1, k_max=6)
        out = speculative_generate(model, tok, [prompt], 16, make(), length, stop_tokens=set())
        assert out.sequences[0].token_ids == reference[i], (draft_name, i)


@pytest.mark.parametrize("draft_name", ["lookup", "lookup-scaled", "self-int4-1layer", "self-all-layers", "other-model",
                                        "self-shared-kv", "self-subset-head"])
def test_a_batch_keeps_different_lengths_per_row_and_equals_each_row_alone(llama_and_gemma, draft_name):
    llama, gemma, tok = llama_and_gemma
    prompts = _prompts(6)
    reference = _ids(generate(llama, tok, prompts, 16, stop_tokens=set()))
    alone = [speculative_generate(llama, tok, [p], 16, _drafts(llama, tok, gemma)[draft_name](), DraftLength(4),
                                  stop_tokens=set()).sequences[0].token_ids for p in prompts]
    batched = speculative_generate(llama, tok, prompts, 16, _drafts(llama, tok, gemma)[draft_name](),
                                   DraftLength(4), stop_tokens=set())
    assert _ids(batched) == alone == reference
    if draft_name in ("self-int4-1layer", "other-model"):  # drafts that partly agree with this random target
        assert len(batched.stats.histogram) > 1  # rows really did keep different numbers of tokens


def test_quantized_kv_caches_roll_back_exactly(llama_and_gemma):
    """With every KV cache kind the engine offers, speculation reproduces the engine on that same cache."""
    from toolkit.kv import KINDS

    llama, _, tok = llama_and_gemma
    prompts = _prompts(4)
    for kind in KINDS:
        reference = _ids(generate(llama, tok, prompts, 16, stop_tokens=set(), kv=KVSpec(kind)))
        for make in (LookupDraft, lambda: LookupDraft(scale_by_match=True),
                     lambda kind=kind: ModelDraft(build_self_draft(llama, bits=None), kv=KVSpec(kind)),
                     lambda: build_draft({"kind": "self", "bits": 4, "group_size": 32, "share_kv": True}, llama, tok)):
            alone = [speculative_generate(llama, tok, [p], 16, make(), DraftLength(3), stop_tokens=set(),
                                          kv=KVSpec(kind)).sequences[0].token_ids for p in prompts]
            assert alone == reference, kind


@pytest.mark.parametrize("name,forward", [("llama", "transformers"), ("llama", "lean"), ("gemma3", "transformers")])
def test_greedy_identity_holds_when_a_flush_falls_inside_a_verify_pass(tiny_llama_dir, tiny_gemma3_dir, name,
                                                                       forward):
    """A quantized cache reads a token back quantized from the step after it leaves the full-precision window. With
    a window of 8 and groups of 8-16 a flush falls inside most verify passes: each row must still read the cache as
    one-token decoding would at its position (docs/speculative.md, "Speculative decoding on a quantized cache"): the lean
    forward updates and attends piece by piece inside each layer, other forwards run the pieces as passes."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.engine.lean_forward import install

    path = tiny_llama_dir if name == "llama" else tiny_gemma3_dir
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    assert install(model, forward) == forward
    prompts = _prompts(6)
    for bits, group in [(8, 8), (4, 16), (2, 16)]:
        kind = OmegaConf.create({"kind": f"int{bits}", "bits": bits, "group_size": group, "residual": 8})
        # one at a time: in a left-padded batch the padding would move where each sequence's flushes fall
        kv = KVSpec.from_node(kind)
        reference = [generate(model, tok, [p], 40, stop_tokens=set(), kv=kv).sequences[0].token_ids
                     for p in prompts]
        for make in (LookupDraft, lambda: build_draft({"kind": "self", "bits": 4, "group_size": 32,
                                                       "share_kv": True}, model, tok)):
            alone = [speculative_generate(model, tok, [p], 40, make(), DraftLength(4), stop_tokens=set(),
                                          kv=kv).sequences[0].token_ids for p in prompts]
            assert alone == reference, (bits, group)


def test_stop_tokens_and_the_token_budget_are_exact(llama_and_gemma):
    llama, _, tok = llama_and_gemma
    prompts = _prompts(6)
    free = _ids(generate(llama, tok, prompts, 30, stop_tokens=set()))
    stop = {free[0][7], free[3][12]}  # tokens that occur mid-generation
    reference = generate(llama, tok, prompts, 30, stop_tokens=stop)
    for draft in (LookupDraft(), ModelDraft(build_self_draft(llama, bits=None))):
        out = speculative_generate(llama, tok, prompts, 30, draft, DraftLength(6), stop_tokens=stop)
        assert _ids(out) == _ids(reference)
        assert [s.finish_reason for s in out.sequences] == [s.finish_reason for s in reference.sequences]
        assert all(len(s.token_ids) <= 30 and not stop & set(s.token_ids) for s in out.sequences)
    for n in (1, 2, 5):  # budgets below k: the self-draft would keep everything, so only the budget stops it
        out = speculative_generate(llama, tok, prompts[:2], n, ModelDraft(build_self_draft(llama, bits=None)),
                                   DraftLength(8), stop_tokens=set())
        assert [len(s.token_ids) for s in out.sequences] == [n, n]


def test_stop_strings_cut_the_text_as_the_engine_does(llama_and_gemma):
    llama, _, tok = llama_and_gemma
    prompt = _prompts(2)[1]
    free = generate(llama, tok, [prompt], 30, stop_tokens=set()).sequences[0].text
    stop = free[10:13]
    reference = generate(llama, tok, [prompt], 30, stop_tokens=set(), stop_strings=[stop]).sequences[0]
    out = speculative_generate(llama, tok, [prompt], 30, LookupDraft(), DraftLength(5), stop_tokens=set(),
                               stop_strings=[stop]).sequences[0]
    assert (out.text, out.finish_reason) == (reference.text, reference.finish_reason) and stop not in out.text


def test_rollback_leaves_the_cache_as_if_the_rejected_tokens_never_ran(llama_and_gemma):
    from toolkit.kv import make_kv_cache

    llama, _, tok = llama_and_gemma
    a, b, c = [5, 9, 31, 77, 120], [33, 44, 55, 66], [200, 201, 202]

    def batch():
        return RaggedBatch(llama, make_kv_cache(llama, 64), 2, tok.pad_token_id)

    rolled = batch()
    rolled.mark()
    rolled.feed([a + b, a[:3]])
    rolled.keep([len(a), 3])  # row 0 drops b; row 1 keeps all it was given
    rolled.mark()
    got = rolled.feed([c, c])
    fresh = batch()
    fresh.mark()
    fresh.feed([a, a[:3]])
    want = fresh.feed([c, c])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert rolled.counts.tolist() == [len(a) + len(c), 3 + len(c)]


def test_a_draft_with_another_tokenizer_is_a_clear_error(llama_and_gemma, tiny_tokenizer):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    _, gemma, tok = llama_and_gemma
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(["a different corpus entirely " * 50], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"], show_progress=False))
    other_tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>", pad_token="<pad>")
    with pytest.raises(InputError, match="tokenizer does not match") as err:
        ModelDraft(gemma, target_tokenizer=tok, draft_tokenizer=other_tok)
    assert "same tokenizer" in str(err.value)
    ModelDraft(gemma, target_tokenizer=tok, draft_tokenizer=tiny_tokenizer)  # equal vocabularies pass


# ---------------------------------------------------------------------------------------------- the verify rule


def test_greedy_verify_keeps_the_matching_prefix_and_adds_the_targets_token():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 2]):
        logits[row, best] = 1.0
    assert greedy_verify(logits, [3, 5, 7]).tokens([3, 5, 7]) == [3, 5, 7, 2]  # all kept + bonus
    assert greedy_verify(logits, [3, 6, 7]).tokens([3, 6, 7]) == [3, 5]  # rejected at 1: the target's 5
    assert greedy_verify(logits[:1], []).tokens([]) == [3]  # nothing drafted: a plain decode step


def _accept_then_resample_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The first emitted token's exact distribution under the rule: draw x ~ q, keep it with min(1, p(x)/q(x)),
    else draw from residual(p, q)."""
    keep = torch.where(q > 0, torch.minimum(torch.ones_like(p), p / q.clamp_min(1e-30)), torch.zeros_like(p))
    return q * keep + (q * (1 - keep)).sum() * residual(p, q)


@pytest.mark.parametrize("seed", range(5))
def test_accept_and_resample_give_exactly_the_target_distribution(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(8, generator=g) ** 3
    q = torch.rand(8, generator=g) ** 3
    p[0], q[1] = 0.0, 0.0  # a token only the draft proposes, one only the target does
    p, q = p / p.sum(), q / q.sum()
    torch.testing.assert_close(_accept_then_resample_distribution(p, q), p, rtol=0, atol=1e-6)
    torch.testing.assert_close(_accept_then_resample_distribution(p, p), p, rtol=0, atol=1e-6)  # q == p: all kept


def _chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    n = counts.sum()
    keep = expected_probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    e = expected_probs[keep] * n
    stat = float(((counts[keep] - e) ** 2 / e).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_rejection_verify_samples_the_target_over_two_positions():
    """Run the code itself on explicit p (two positions + bonus) and q: the emitted pair is distributed as p x p."""
    g = torch.Generator().manual_seed(1)
    vocab = 4
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.0, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.6, 0.1, 0.2]])
    counts = torch.zeros(vocab, vocab)
    for _ in range(6000):
        drafted = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(2)]
        tokens = rejection_verify(p, q, drafted, g).tokens(drafted)
        if len(tokens) == 1:  # rejected at the first position: the second token comes from p[1] next round
            tokens.append(int(torch.multinomial(p[1], 1, generator=g)))
        counts[tokens[0], tokens[1]] += 1
    assert _chi_square_p_value(counts.flatten(), (p[0][:, None] * p[1][None, :]).flatten()) > 1e-3


def test_a_deterministic_draft_is_verified_as_one_hot():
    g = torch.Generator().manual_seed(2)
    p = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    counts = torch.zeros(3)
    for _ in range(4000):
        counts[rejection_verify(p, None, [1], g).tokens([1])[0]] += 1
    assert _chi_square_p_value(counts, p[0]) > 1e-3


def test_sampled_speculation_matches_target_only_sampling_on_a_model(llama_and_gemma):
    """Thousands of seeded samples of three tokens (top-k 2, so 8 outcomes) from a tiny model with an int4
    self-draft (close to the target, not equal: both accept and reject happen): chi-square against the exact target
    distribution, computed from the target's own logits."""
    llama, _, tok = llama_and_gemma
    params = SamplingParams(temperature=1.5, top_k=2, seed=0)
    prompt = tok(_prompts(3)[2]).input_ids
    n = 1500
    out = speculative_generate(llama, tok, [prompt] * n, 3, ModelDraft(build_self_draft(llama, bits=4, group_size=32),
                                                                       params),
                               DraftLength(2), params, stop_tokens=set())
    assert out.stats.accepted > 0 and out.stats.accepted < out.stats.proposed  # both branches of the rule ran
    _assert_target_distribution([tuple(s.token_ids) for s in out.sequences], llama, prompt, params)


def test_sampled_speculation_with_the_targets_keys_and_values_matches_target_only_sampling(llama_and_gemma):
    """The same check for the spec=self default draft, which reads the target's cache (`share_kv`; one sequence
    at a time, so each sample is its own generation, all drawing from one seeded generator)."""
    llama, _, tok = llama_and_gemma
    params = SamplingParams(temperature=1.5, top_k=2, seed=0)
    prompt = tok(_prompts(3)[2]).input_ids
    draft = build_draft({"kind": "self", "bits": 4, "group_size": 32, "share_kv": True, "head_bits": 8},
                        llama, tok, sampling=params)
    generator = torch.Generator().manual_seed(0)
    samples, proposed, accepted = [], 0, 0
    for _ in range(1200):
        out = speculative_generate(llama, tok, [prompt], 3, draft, DraftLength(2), params, stop_tokens=set(),
                                   generator=generator)
        samples.append(tuple(out.sequences[0].token_ids))
        proposed, accepted = proposed + out.stats.proposed, accepted + out.stats.accepted
    assert draft.target is not None  # the draft really read the target's cache
    assert 0 < accepted < proposed
    _assert_target_distribution(samples, llama, prompt, params)


def _assert_target_distribution(samples, model, prompt, params):
    """Chi-square of three-token samples against the exact distribution of the target sampled alone."""
    exact = {}
    with torch.inference_mode():
        def dist(ids):
            return probabilities(model(torch.tensor([ids])).logits[0, -1], params)
        p1 = dist(prompt)
        for t1 in p1.nonzero().flatten().tolist():
            p2 = dist(prompt + [t1])
            for t2 in p2.nonzero().flatten().tolist():
                p3 = dist(prompt + [t1, t2])
                for t3 in p3.nonzero().flatten().tolist():
                    exact[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    assert set(samples) <= set(exact)
    keys = sorted(exact)
    counts = torch.tensor([samples.count(k) for k in keys], dtype=torch.float64)
    assert _chi_square_p_value(counts, torch.tensor([exact[k] for k in keys], dtype=torch.float64)) > 1e-3


# ---------------------------------------------------------------------------------------------- pieces


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


def test_sampled_speculation_with_a_subset_head_matches_target_only_sampling(llama_and_gemma):
    """A draft whose head cannot propose some of the target's likely tokens (q = 0 there) still samples exactly the
    target's distribution: rejection sampling resamples from max(p - q, 0), which covers the tokens q misses."""
    llama, _, tok = llama_and_gemma
    params = SamplingParams(temperature=1.5, top_k=2, seed=0)
    prompt = tok(_prompts(3)[2]).input_ids
    with torch.inference_mode():
        top = probabilities(llama(torch.tensor([prompt])).logits[0, -1], params).nonzero().flatten().tolist()
    outside = [t for t in top if t not in prompt]
    assert outside  # the test needs a likely first token that the context does not hold
    model = build_self_draft(llama, bits=4, group_size=32)
    vocab = llama.get_output_embeddings().weight.shape[0]
    keep = torch.tensor([t for t in range(vocab) if t not in outside])
    quantize_draft_head(model, 8, 32, vocab=keep[:len(keep) // 16 * 16])
    draft = ModelDraft(model, params, target_vocab=vocab)
    out = speculative_generate(llama, tok, [prompt] * 1500, 3, draft, DraftLength(2), params, stop_tokens=set())
    assert 0 < out.stats.accepted < out.stats.proposed
    samples = [tuple(s.token_ids) for s in out.sequences]
    assert any(s[0] in outside for s in samples)  # the target's token the draft could not propose came out
    _assert_target_distribution(samples, llama, prompt, params)


def test_transformers_assisted_lookup_peer_runs_greedy_and_matches_its_plain_generate(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from toolkit.bench.peers import assisted_lookup_peer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    repetitive = [5, 6, 7, 8, 9, 10] * 6  # n-grams to look up
    peer = assisted_lookup_peer(model, [repetitive, list(range(20, 60))], new_tokens=12, k=4, repeats=1, warmup=0)
    assert peer["identical_outputs"] is True and peer["k"] == 4
    for path in ("generate", "assisted"):
        assert peer[path]["runs"] == 2 and peer[path]["tokens_per_s"] > 0 and peer[path]["ttft_ms"] > 0
    assert peer["speedup_vs_generate"] > 0


def test_transformers_assisted_draft_peer_runs_the_draft_model_and_matches_its_plain_generate(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from toolkit.bench.peers import assisted_draft_peer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    calls = []
    assistant.register_forward_hook(lambda *args: calls.append(1))
    peer = assisted_draft_peer(model, assistant, [list(range(20, 60))], new_tokens=12, repeats=1, warmup=0)
    assert peer["identical_outputs"] is True and calls  # the assistant really drafted
    assert peer["assistant_settings"]["num_assistant_tokens"] == 20  # transformers' default, reported as such
    for path in ("generate", "assisted"):
        assert peer[path]["runs"] == 1 and peer[path]["tokens_per_s"] > 0


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
    (Greedy identity on quantized caches: test_quantized_kv_caches_roll_back_exactly, and with a window this short,
    where flushes fall inside verify passes, test_greedy_identity_holds_when_a_flush_falls_inside_a_verify_pass.)"""
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


def test_the_assisted_peer_of_a_quantized_draft_checkpoint_runs_the_float_model_it_was_made_from(
        tiny_llama_dir, tiny_tokenizer, tmp_path, monkeypatch):
    """spec=draft with one of our int4 checkpoints: transformers' assisted generation gets the same pair as it can
    run it, the checkpoint's float source (from its manifest), not no peer at all."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    import toolkit.bench.peers as peers
    from toolkit.bench.spec import _peer
    from toolkit.quant.checkpoint import save_quantized
    from toolkit.quant.model_quant import QuantRecipe, quantize_model

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    qsd = quantize_model(model, QuantRecipe(method="rtn", bits=4, group_size=32))
    ck = save_quantized(tmp_path / "ck", model, qsd, tokenizer=tiny_tokenizer, source=str(tiny_llama_dir))
    seen = {}

    def fake_peer(target, assistant, *args, **kwargs):
        seen["assistant"] = assistant
        return {"identical_outputs": True}

    monkeypatch.setattr(peers, "assisted_draft_peer", fake_peer)
    spec_cfg = OmegaConf.create({"kind": "draft", "model": str(ck)})
    result = _peer(str(tiny_llama_dir), spec_cfg, [[20, 21, 22]], 4, DraftLength(), 1, 0, "fp32")
    assert result["peer_assisted"]["draft"] == str(tiny_llama_dir)
    assert type(seen["assistant"]).__name__ == "LlamaForCausalLM"
    assert not any("Quant" in type(m).__name__ for m in seen["assistant"].modules())  # the float model
