"""Pre-RoPE key quantization (as KVQuant found): keys are un-rotated before they are quantized and rotated back when
read, so each channel's group holds one feature's values instead of a feature spun by position.

Attention hands the cache keys after RoPE, where channel pairs (i, i + d/2) rotate by position * inv_freq[i]. For the
fast pairs a channel swings across its whole range within a few tokens, so a per-channel scale over 128 tokens sees
that swing instead of the feature's own spread; at 2 bits that costs more than anything else (SmolLM2, g128 r32: see
docs/kv-cache.md).

Exactness never depends on matching the model's rotation: un-rotating token i by angle i * f and rotating back by the
same angle is the identity up to rounding, whatever f and whatever the token's true position (left padding shifts a
row's positions by a constant, a constant rotation per row). The model's own frequencies only make the groups
tighter. Positions are cache indices.

Only the fast pairs are turned: those whose angle moves at least a radian across one key group (`span` tokens). A
slow pair barely moves within a group, so un-rotating it changes nothing there, and rotating it back would cost
time at every step: on SmolLM2 at g128, 14 of 32 pairs are fast.
"""

import torch
from torch import nn

from toolkit.errors import InputError

MIN_ANGLE = 1.0  # radians a pair must turn across one key group to be un-rotated


class RotaryTable:
    """cos/sin of position * inv_freq for positions 0..max_length-1 (fp32, [max_length, pairs turned]): one table
    per distinct frequency set, shared by the layers that use it; a function of position only, not per sequence.
    With `span`, only the leading pairs turning at least MIN_ANGLE over `span` tokens (RoPE's frequencies fall with
    the pair index); without, every pair."""

    def __init__(self, inv_freq: torch.Tensor, max_length: int, span: int | None = None):
        self.half = inv_freq.numel()  # the partner of channel i is channel i + half
        turns = inv_freq.cpu().double() * span >= MIN_ANGLE if span else torch.ones(inv_freq.numel(), dtype=bool)
        fast = int(turns.sum())
        if not bool(turns[:fast].all()):
            fast = inv_freq.numel()  # the turning pairs are not the leading ones: turn them all
        angles = torch.outer(torch.arange(max_length, dtype=torch.float64), inv_freq[:fast].double().cpu())
        self.cos = angles.cos().float().to(inv_freq.device)
        self.sin = angles.sin().float().to(inv_freq.device)
        self.pairs = fast
        self._scratch = None  # a * sin of the first half before it is rewritten (shared by the layers)

    def rotate_(self, x: torch.Tensor, start: int, inverse: bool = False) -> torch.Tensor:
        """Rotate fp32 x [..., n, D] in place as RoPE does (rotate_half pairs (i, i + half), i < self.pairs) for
        positions start..start+n; `inverse` rotates back."""
        h, n = self.half, x.shape[-2]
        cos, sin = self.cos[start:start + n], self.sin[start:start + n]
        a, b = x[..., :self.pairs], x[..., h:h + self.pairs]
        if self._scratch is None or self._scratch.numel() < a.numel():
            self._scratch = torch.empty(a.numel(), dtype=x.dtype, device=x.device)
        a_sin = torch.mul(a, sin, out=self._scratch[:a.numel()].view(a.shape))  # a reused buffer, not a fresh one
        # forward: a' = a cos - b sin, b' = b cos + a sin; the inverse flips the sign of sin
        a.mul_(cos).addcmul_(b, sin, value=1.0 if inverse else -1.0)
        b.mul_(cos).add_(a_sin, alpha=-1.0 if inverse else 1.0)
        return x


def rope_frequencies(model, num_layers: int, setting: str = "kv.pre_rope") -> list[torch.Tensor]:
    """The inv_freq each decoder layer's RoPE uses, read from the model's rotary embedding module (one set, or one per
    layer type as Gemma 3 keeps them); `setting`: the option that needs them, named in the error."""
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    if isinstance(rotary, nn.Module):
        config = model.config.get_text_config(decoder=True)
        if isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
            return [rotary.inv_freq] * num_layers
        layer_types = getattr(config, "layer_types", None)
        if layer_types and all(isinstance(getattr(rotary, f"{t}_inv_freq", None), torch.Tensor) for t in layer_types):
            return [getattr(rotary, f"{t}_inv_freq") for t in layer_types[:num_layers]]
    fix = "kv.pre_rope=false" if setting == "kv.pre_rope" else f"{setting}=0"
    raise InputError(f"{setting} needs the model's rotary embedding frequencies, and none were found in "
                     f"{type(model).__name__}", f"set {fix} for this model")


def rotary_tables(freqs: list[torch.Tensor], max_length: int, span: int | None = None) -> list[RotaryTable]:
    """One table per layer, built once per distinct frequency tensor."""
    built: dict[int, RotaryTable] = {}
    for f in freqs:
        if id(f) not in built:
            built[id(f)] = RotaryTable(f, max_length, span)
    return [built[id(f)] for f in freqs]
