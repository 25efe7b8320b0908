"""Pure tensor maths for quality figures. Inputs are logits [..., vocab]; outputs are sums and counts so callers can
accumulate over batches and divide once (a mean of per-batch means would weight short batches wrongly)."""

import math

import torch


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) at each position: logits [..., T, V], targets [..., T] -> [..., T] in fp32."""
    return logits.float().log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)


def perplexity(nll_sum: float, count: int) -> float:
    """exp(mean negative log-likelihood per scored token)."""
    return math.exp(nll_sum / count)


def kl_sum(reference_logits: torch.Tensor, candidate_logits: torch.Tensor) -> float:
    """Sum over positions of KL(reference || candidate) in nats: how much probability mass the candidate moves
    away from where the reference puts it."""
    ref = reference_logits.float().log_softmax(-1)
    got = candidate_logits.float().log_softmax(-1)
    return (ref.exp() * (ref - got)).sum(-1).sum().item()


def top1_matches(reference_logits: torch.Tensor, candidate_logits: torch.Tensor) -> int:
    """Positions where both models' most likely next token is the same."""
    return int((reference_logits.argmax(-1) == candidate_logits.argmax(-1)).sum().item())


class Accumulator:
    """Running sums for one model's perplexity and, against a reference, KL and top-1 agreement."""

    def __init__(self):
        self.nll = 0.0
        self.ref_nll = 0.0
        self.kl = 0.0
        self.matches = 0
        self.count = 0

    def add(self, logits: torch.Tensor, ref_logits: torch.Tensor, targets: torch.Tensor) -> None:
        """logits/ref_logits [B, T, V] predicting targets [B, T] (already shifted). Passing the same tensor twice
        (the candidate is its own reference) counts it once: KL 0, agreement 1, with no second softmax."""
        nll = -target_logprobs(logits, targets).sum().item()
        count = targets.numel()
        self.nll += nll
        self.count += count
        if ref_logits is logits:
            self.ref_nll += nll
            self.matches += count
            return
        self.ref_nll -= target_logprobs(ref_logits, targets).sum().item()
        self.kl += kl_sum(ref_logits, logits)
        self.matches += top1_matches(ref_logits, logits)

    def figures(self) -> dict:
        return {"ppl": perplexity(self.nll, self.count), "ref_ppl": perplexity(self.ref_nll, self.count),
                "kl": self.kl / self.count, "top1_agreement": self.matches / self.count}
