"""Speculative decoding's verify rule (toolkit/spec/verify.py): greedy verification keeps the matching prefix and adds
the target's token; accept/resample gives exactly the target's distribution, on explicit distributions (exact and
chi-square) and on a model, for an int4 self-draft, the draft reading the target's keys and values, and a draft whose
subset head cannot propose some of the target's tokens."""

import pytest
import torch

from tests.test_spec import _prompts
from toolkit.engine.sampling import SamplingParams, probabilities
from toolkit.spec.build import build_draft
from toolkit.spec.decode import DraftLength, speculative_generate
from toolkit.spec.draft_head import quantize_draft_head
from toolkit.spec.drafts import ModelDraft
from toolkit.spec.self_draft import build_self_draft
from toolkit.spec.verify import greedy_verify, rejection_verify, residual

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


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
