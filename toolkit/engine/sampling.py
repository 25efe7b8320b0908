"""Token choice from logits: greedy, or sampling with temperature, top-k and top-p.

`probabilities` is kept separate from `sample` because speculative decoding needs the exact distribution that
sampling draws from (the same temperature/top-k/top-p applied to target and draft) for rejection sampling.

No accepted setting can make the distribution inf/NaN: a temperature below GREEDY_BELOW is greedy (the limit of
sampling as the temperature goes to 0; dividing logits by 1e-45 would overflow float32); logits that would still
overflow are shifted so their largest finite value is 0 before dividing; and a row whose distribution is still not
finite (NaN logits from upstream) falls back to its argmax.
"""

import math
from dataclasses import dataclass

import torch

from toolkit.errors import InputError

GREEDY_BELOW = 1e-4  # temperatures below this decode greedily (at 1e-4 a logit gap of 0.01 already means e^-100)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # 1 means no nucleus cut
    seed: int | None = None

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(self, name)):
                raise InputError(f"{name} must be a finite number, got {getattr(self, name)}", f"set {name} to a number")
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}", "use 0 for greedy decoding")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}", "use 0 to disable top-k")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}", "use 1.0 to disable nucleus sampling")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def generator(self, device="cpu") -> torch.Generator | None:
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(int(self.seed))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)`: the first index of the largest value (of the first NaN, where there is one), int64. For
    fp32 on the CPU through numpy's reduction, which vectorizes where torch's does not: a SmolLM2 verify pass's
    6 x 49152 logits 22 against 131 us here, Qwen2.5's 151936 12 against 128 us, paid at every decode step and
    every drafted token."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad and logits.dim():
        return torch.as_tensor(logits.detach().numpy().argmax(-1), dtype=torch.int64)
    return logits.argmax(-1)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from, [..., vocab] float32; one-hot on the argmax when greedy."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    scaled = logits / params.temperature
    # only a temperature below 1 can overflow a finite logit: then shift the largest finite logit to 0 first, so a
    # small temperature only sends the others towards -inf
    if params.temperature < 1:
        finite = torch.isfinite(logits)
        if not bool((torch.isfinite(scaled) | ~finite).all()):
            top = torch.where(finite, logits, torch.finfo(logits.dtype).min).amax(-1, keepdim=True)
            scaled = torch.where(finite, logits - top, float("-inf")) / params.temperature
    logits = scaled
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already cover top_p; the most likely token always stays.
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= params.top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probs = logits.softmax(-1)
    bad = ~torch.isfinite(probs).all(-1, keepdim=True) | (probs.sum(-1, keepdim=True) <= 0)
    if bool(bad.any()):  # a row of NaN logits (a numerical failure upstream): its argmax, never an invalid tensor
        greedy = torch.nn.functional.one_hot(argmax(torch.nan_to_num(logits, nan=float("-inf"))), logits.shape[-1])
        probs = torch.where(bad, greedy.float(), probs)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens for a batch of logits [batch, vocab] -> [batch] int64."""
    if params.greedy:
        return argmax(logits)
    probs = probabilities(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
