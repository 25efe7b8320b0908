"""The verify step of speculative decoding, pure: given the target's logits over the drafted positions, decide how
many drafted tokens to keep and which token comes next. No model, no cache: the loop (spec/decode.py) owns those.

Greedy: keep the longest prefix of the draft equal to the target's argmax, then append the target's own argmax at
the first mismatch (or after the last draft token). The output is then token-identical to the target alone.

Sampling (Leviathan et al. 2023; Chen et al. 2023): draft token x with draft probability q(x) is kept with
probability min(1, p(x)/q(x)); at the first rejection the next token is drawn from norm(max(p - q, 0)); when all are
kept a bonus token is drawn from p at the position after the last. The emitted tokens are then distributed exactly
as if sampled from p alone. p and q are the distributions `engine.sampling.probabilities` returns, so temperature,
top-k and top-p act on both identically.
"""

from dataclasses import dataclass

import torch

from toolkit.engine.sampling import SamplingParams, argmax, probabilities


@dataclass(frozen=True)
class Verdict:
    accepted: int  # drafted tokens kept (0..n)
    next_token: int  # the target's correction (on rejection) or bonus token (all kept)

    def tokens(self, drafted: list[int]) -> list[int]:
        """What this round emits: the kept draft prefix, then the next token."""
        return list(drafted[:self.accepted]) + [self.next_token]


def greedy_verify(target_logits: torch.Tensor, drafted: list[int]) -> Verdict:
    """`target_logits` [n+1, vocab]: row j scores the position of drafted[j] (row n: the one after the last)."""
    choice = argmax(target_logits).tolist()
    accepted = 0
    while accepted < len(drafted) and drafted[accepted] == choice[accepted]:
        accepted += 1
    return Verdict(accepted, choice[accepted])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)): where to resample after a rejection. When p <= q everywhere the rejection had
    probability 0 (p == q); fall back to p so a numerically impossible branch still returns a distribution."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


def rejection_verify(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, drafted: list[int],
                     generator: torch.Generator | None = None) -> Verdict:
    """`target_probs` [n+1, vocab] (p per position), `draft_probs` [n, vocab] (q per drafted position; None for a
    deterministic draft, i.e. q one-hot on the drafted token)."""
    n = len(drafted)
    for j, x in enumerate(drafted):
        p = target_probs[j]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[x] = 1.0
        else:
            q = draft_probs[j]
        # u < p/q without dividing (a draft that drew x has q(x) > 0)
        u = torch.rand((), generator=generator, device=p.device)
        if float(u * q[x]) < float(p[x]):
            continue
        return Verdict(j, int(torch.multinomial(residual(p, q), 1, generator=generator)))
    return Verdict(n, int(torch.multinomial(target_probs[n], 1, generator=generator)))


def verify(target_logits: torch.Tensor, drafted: list[int], draft_probs: torch.Tensor | None,
           params: SamplingParams, generator: torch.Generator | None = None) -> Verdict:
    """One sequence's verdict from the target's logits [n+1, vocab] over its n drafted tokens."""
    if params.greedy:
        return greedy_verify(target_logits, drafted)
    return rejection_verify(probabilities(target_logits, params), draft_probs, drafted, generator)
