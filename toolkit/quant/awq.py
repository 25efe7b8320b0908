"""AWQ (Lin et al., 2023): protect the input channels that carry large activations by scaling them up before
quantization, with the inverse scale folded into the op that produces those inputs, so the float model computes
the same function and only the rounding changes. Then shrink each group's clipping range where that lowers the
output error. Codes are then plain round-to-nearest on the scaled, clipped weight (the `primitives` grid).

One block at a time, on the float inputs each Linear saw (`InputCollector`):

1. **Scale search** per *scaling group* (Linears that read one tensor, and the op that writes it):
   ``input_layernorm -> q,k,v``; ``post_attention_layernorm`` (Llama/Qwen) or ``pre_feedforward_layernorm``
   (Gemma 3) ``-> gate,up``; ``up -> down``; ``v -> o`` when v's outputs are o's inputs one to one (no GQA head
   sharing), and under GQA with ``gqa_v_o``: each query head reads its kv head's values, so o's input channel
   ``h * head_dim + d`` is v's output ``(h // group) * head_dim + d`` and one scale per v output, shared by the
   ``group`` query heads that read it, folds exactly (AutoAWQ skips GQA models' v -> o). Which norm feeds which
   Linears is not guessed from names: the driver's capture forward records each norm's output tensor and a
   group's producer is the norm whose output IS the Linears' input. For ``alpha`` on a grid in [0, 1]:
   ``s = mean|x|^alpha`` (normalised by ``sqrt(max s * min s)``), ``W' = Q(W * s) / s``, and the loss is the mean
   squared error of the group's output against the float output on ``search_samples`` calibration sequences; the
   best ``alpha`` wins. The output
   measured is the MLP's for gate/up (it is nonlinear in them; AutoAWQ does the same; ``mlp_dtype="bf16"``
   runs those candidates in bf16) and the Linears' own outputs otherwise, measured through the inputs' Gram
   matrix: the same loss. (AutoAWQ runs the whole attention for q,k,v; measured, that was better on Gemma's plain
   recipe, mixed on SmolLM2 and on Gemma's best search, at twice the search time: docs/notes/2026-12-gemma-awq-what-was-tried.md.)
   ``duo_scaling`` uses AutoAWQ's later ``s = mean|x|^a / mean|w|^(1-a)``.
2. **Fold**: the Linears' input columns are multiplied by ``s``; the producer's output is divided by ``s``:
   an RMSNorm weight ``w -> w / s``, or for Gemma's ``(1 + w)`` norm ``w -> (1 + w) / s - 1`` (the norm kind is
   probed numerically, not taken from a class name); a Linear producer's rows and bias ``/ s``.
3. **Clip search** (all Linears except q and k, whose errors the attention softmax magnifies; as AutoAWQ):
   per output channel and group, ``max|w|`` is shrunk by ``i / clip_grid`` for ``i < max_shrink * clip_grid``
   and the value with the least error of ``x · w`` per group, on ``clip_tokens`` tokens, is kept
   (the weight is clamped to ``±max``).
4. **Rounding**: round-to-nearest on the scaled, clipped weight (``rounding=None``, the paper's), or GPTQ
   (``rounding=`` a `GPTQLayerQuantizer`, recipe ``awq_rounding: gptq``): GPTQ's column-by-column error feedback
   on the scaled weight, under the Hessian of the inputs the Linear now reads, ``x / s``. That Hessian needs no
   second pass over the data: ``H' = H / (s sᵀ)`` from the Hessian of the collected float inputs ``x``. AWQ chooses
   the scales, GPTQ the codes (llm-compressor's AWQ-then-GPTQ recipe; docs/notes/2026-12-quantization-methods-what-was-tried.md "AWQ scales with GPTQ rounding").
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from toolkit.quant.gptq import HessianAccumulator
from toolkit.quant.primitives import (
    QuantConfig,
    choose_qparams,
    dequantize,
    pad_to_groups,
    quantize,
)
from toolkit.quant.quantized_weight import QuantizedWeight
from toolkit.quant.rtn import rtn_quantize


@dataclasses.dataclass(frozen=True)
class AWQOptions:
    """Every knob of the paper / AutoAWQ, by name."""

    grid: int = 20  # alphas tried: i / grid for i in range(grid)  (AutoAWQ n_grid)
    # 1: every alpha of the grid (AutoAWQ). s > 1: every s-th alpha first, then the grid alphas within s - 1 of the
    # best of those (11-12 of 20 losses at s = 2). A loss curve over alpha need not have a single minimum (40 of
    # SmolLM2's 90 do not), but its minimum is broad: at s = 2 the search picked the full grid's alpha in 89 of 90
    # groups (the other: +0.4% loss), docs/notes/2026-12-quantization-quality-and-time.md "AWQ's coarse-to-fine alpha search"
    coarse_step: int = 1
    duo_scaling: bool = False  # False: the paper's s = mean|x|^a; True: AutoAWQ's mean|x|^a / mean|w|^(1-a)
    clip: bool = True  # run the clip search after scaling
    clip_grid: int = 20  # shrink steps of max|w| (AutoAWQ n_grid in _compute_best_clip)
    max_shrink: float = 0.5  # shrink max|w| by at most this fraction
    clip_tokens: int = 512  # tokens (evenly spaced over the calibration data) the clip search measures on
    # asymmetric grids: after the symmetric search, shrink each group's upper and lower ends separately
    # (`search_clip_range`); False: AutoAWQ's clamp to [-m, m]
    clip_asym: bool = False
    search_samples: int = 8  # calibration sequences the scale search measures its loss on (means use all)
    mlp_dtype: str = "fp32"  # "bf16": the gate,up group's MLP candidates run in bf16 (native-bf16 hardware)
    # v -> o under GQA too: one scale per v output channel, shared by the query heads reading that kv head (False:
    # AutoAWQ's rule, v -> o only when o's inputs are v's outputs one to one)
    gqa_v_o: bool = False

    def __post_init__(self):
        if self.mlp_dtype not in ("fp32", "bf16"):
            raise ValueError(f"AWQ mlp_dtype must be fp32 or bf16, got {self.mlp_dtype!r}")
        if (self.grid < 1 or self.clip_grid < 1 or self.clip_tokens < 1 or self.search_samples < 1
                or self.coarse_step < 1):
            raise ValueError("AWQ grid, coarse_step, clip_grid, clip_tokens and search_samples must be >= 1")
        if not 0.0 <= self.max_shrink < 1.0:
            raise ValueError(f"AWQ max_shrink must be in [0, 1), got {self.max_shrink}")


class InputCollector:
    """Keeps every input tensor a Linear receives (references: Linears fed one tensor share the memory)."""

    def __init__(self):
        self.inputs: list[torch.Tensor] = []

    def add(self, x: torch.Tensor) -> None:
        self.inputs.append(x.detach())

    def _flat(self) -> list[torch.Tensor]:
        return [x.reshape(-1, x.shape[-1]) for x in self.inputs]

    @property
    def n_rows(self) -> int:
        return sum(x.shape[0] for x in self._flat())

    def take_rows(self, index: torch.Tensor) -> torch.Tensor:
        """float32 rows at flat token positions ``index`` (ascending), without materializing the others."""
        picked, start = [], 0
        for x in self._flat():
            mine = index[(index >= start) & (index < start + x.shape[0])] - start
            picked.append(x[mine].to(torch.float32))
            start += x.shape[0]
        return torch.cat(picked)

    def mean_abs(self) -> torch.Tensor:
        """``mean|x|`` per input channel over every row, float32, summed in chunks (no full-size temporaries)."""
        total, count = None, 0
        for x in self._flat():
            for chunk in x.split(8192):
                # a float32 COPY even of float32 inputs (`.float()` would return the collected tensor itself and
                # abs_ would overwrite it with |x|), then in place (2x vector_norm(ord=1, dtype=float32) on bf16)
                part = chunk.to(torch.float32, copy=True).abs_().sum(0)
                total = part if total is None else total + part
                count += chunk.shape[0]
        return total / count


class _SearchRows:
    """What the searches read of one input tensor: ``mean|x|`` over all rows, the scale search's first
    ``n_search`` rows and the clip search's evenly spaced rows (float32 copies a fold divides by ``s``)."""

    def __init__(self, collector: InputCollector, n_search: int, clip_tokens: int):
        total = collector.n_rows
        self.mean_abs = collector.mean_abs()
        self.search = collector.take_rows(torch.arange(min(n_search, total)))
        step = max(1, total // clip_tokens)  # as `search_clip` would subsample all rows
        self.clip = collector.take_rows(torch.arange(0, total, step)[:clip_tokens])

    def div_(self, s: torch.Tensor) -> None:  # (mean_abs has been used by then: one scale search per input)
        self.search.div_(s)
        self.clip.div_(s)


def fake_quantize(weight: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """``deq(RTN(weight))`` in float32: what the weight becomes on ``config``'s grid."""
    scale, zero = choose_qparams(weight, config)
    return dequantize(quantize(weight, scale, zero, config), scale, zero, config)


# ------------------------------------------------------------------------------------------- scale search

@torch.no_grad()
def search_scales(x: torch.Tensor | None, linears: list[nn.Linear], config: QuantConfig, options: AWQOptions,
                  x_search: torch.Tensor | None = None, inspect=None,
                  x_mean: torch.Tensor | None = None, tie=None) -> tuple[torch.Tensor, float, float]:
    """``(s [in], best alpha, best loss)`` for Linears that all read ``x [tokens, in]`` (float32 rows).

    ``mean|x|`` comes from all of ``x`` (or is given: ``x_mean``); the loss is measured on ``x_search`` (default
    ``x``). ``inspect(x)`` maps the group's input to the output whose error counts (default: the Linears' outputs
    concatenated). ``tie(s)`` makes a candidate obey a sharing constraint (`_KVHeads.tie`: one scale per kv
    channel) before it is normalised and tried.
    """
    x_search = x if x_search is None else x_search
    x_mean = x.abs().mean(0) if x_mean is None else x_mean
    weights = [lin.weight.detach().to(torch.float32) for lin in linears]
    if options.duo_scaling:
        w = torch.cat(weights)
        gs = config.resolve_group_size(w.shape[1])
        grouped = pad_to_groups(w.abs(), config).reshape(w.shape[0], -1, gs)  # a ragged last group zero-padded
        w_mean = (grouped / grouped.amax(-1, keepdim=True).clamp(min=1e-8)).reshape(w.shape[0], -1)
        w_mean = w_mean[:, :w.shape[1]].mean(0)

    if inspect is not None:
        reference = inspect(x_search, weights)

        def loss_of(ws):
            return float((inspect(x_search, ws) - reference).pow(2).mean())
    else:
        # The Linears' own outputs: mean((x ΔWᵀ)²) over tokens and outputs = tr(ΔW G ΔWᵀ) / (tokens * outputs)
        # with G = xᵀx, formed once: each alpha then costs out x in² instead of tokens x in x out (7x less for
        # q,k,v at 4,096 search tokens). The same loss, not an approximation.
        gram = x_search.t() @ x_search
        w_all = torch.cat(weights)
        denominator = x_search.shape[0] * w_all.shape[0]

        def loss_of(ws):
            delta = torch.cat(ws) - w_all
            return float(((delta @ gram) * delta).sum()) / denominator

    tried: dict[int, tuple[torch.Tensor, float]] = {}  # grid index -> (s, loss)

    def try_alpha(i: int) -> None:
        if i in tried:
            return
        alpha = i / options.grid
        if options.duo_scaling:
            s = x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)
        else:
            s = x_mean.pow(alpha)
        s = s.clamp(min=1e-4)
        if tie is not None:
            s = tie(s)
        s = s / (s.max() * s.min()).sqrt()
        tried[i] = (s, loss_of([fake_quantize(w * s, config) / s for w in weights]))

    def best_index() -> int | None:  # the lowest loss, the smaller alpha on ties; None when every loss is NaN
        finite = [(loss, i) for i, (_, loss) in tried.items() if loss == loss]
        return min(finite)[1] if finite else None

    step = options.coarse_step
    for i in range(0, options.grid, step):
        try_alpha(i)
    if step > 1 and (coarse := best_index()) is not None:
        for i in range(max(0, coarse - step + 1), min(options.grid, coarse + step)):
            try_alpha(i)
    best = best_index()
    if best is None:  # every loss NaN: no scaling is the honest fallback
        return torch.ones_like(x_mean), 0.0, float("nan")
    return tried[best][0], best / options.grid, tried[best][1]


# ------------------------------------------------------------------------------------------- folding

def is_norm(name: str, module: nn.Module) -> bool:
    """A norm layer, by the rule the calibration driver and scale tuning share: a leaf module whose own name says
    norm (``input_layernorm``, ``q_norm``, the final ``norm``)."""
    return "norm" in name.rsplit(".", 1)[-1] and not list(module.children())


def norm_kind(norm: nn.Module, hidden: int) -> str:
    """``"plain"`` (output = normed(x) * w, Llama/Qwen) or ``"offset"`` (normed(x) * (1 + w), Gemma), probed."""
    weight = getattr(norm, "weight", None)
    if weight is None or weight.dim() != 1 or weight.numel() != hidden:
        raise ValueError(f"{type(norm).__name__} has no [hidden] weight to fold AWQ scales into")
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(0)).to(weight)
    with torch.no_grad():
        y = norm(x).float()
        eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ratio = y / normed
    w = weight.detach().float()
    if torch.allclose(ratio, w.expand_as(ratio), rtol=1e-3, atol=1e-4):
        return "plain"
    if torch.allclose(ratio, (1 + w).expand_as(ratio), rtol=1e-3, atol=1e-4):
        return "offset"
    raise ValueError(f"cannot fold AWQ scales into {type(norm).__name__}: it is not an RMSNorm of the form "
                     f"normed(x) * w or normed(x) * (1 + w)")


@torch.no_grad()
def fold_scales(producer: nn.Module, linears: list[nn.Linear], s: torch.Tensor,
                producer_s: torch.Tensor | None = None) -> None:
    """Scale the Linears' input columns by ``s`` and divide the producer's outputs by ``s`` (same function);
    ``producer_s``: the producer's outputs' scales where they are fewer than the inputs (v -> o under GQA)."""
    for lin in linears:
        lin.weight.mul_(s.to(lin.weight)[None, :])
    s = s if producer_s is None else producer_s
    if isinstance(producer, nn.Linear):
        producer.weight.div_(s.to(producer.weight)[:, None])
        if producer.bias is not None:
            producer.bias.div_(s.to(producer.bias))
        return
    w = producer.weight
    if norm_kind(producer, w.numel()) == "plain":
        w.div_(s.to(w))
    else:
        w.copy_(((1 + w.float()) / s - 1).to(w))


# ------------------------------------------------------------------------------------------- clip search

def _clip_setup(weight: torch.Tensor, x: torch.Tensor, config: QuantConfig, options: AWQOptions):
    """``(w [out, g, gs], G [g, gs, gs])``: the weight in groups and each group's Gram matrix of ``clip_tokens``
    evenly spaced rows of ``x``; a ragged last group is zero-padded in both (the padding adds nothing)."""
    w_all = weight.detach().to(torch.float32)
    out, cols = w_all.shape
    gs, groups = config.resolve_group_size(cols), config.n_groups(cols)
    step = max(1, x.shape[0] // options.clip_tokens)
    xs = pad_to_groups(x[::step][:options.clip_tokens].to(torch.float32), config).reshape(-1, groups, gs)  # [t, g, gs]
    gram = torch.einsum("tgk,tgl->gkl", xs, xs) / xs.shape[0]  # [g, gs, gs]
    return pad_to_groups(w_all, config).reshape(out, groups, gs), gram


def _clip_errors(w: torch.Tensor, gram: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 config: QuantConfig) -> torch.Tensor:
    """``[out, g]``: each group's output error ``Δ G Δᵀ``, clamped to ``[lo, hi]`` (``[out, g, 1]``) and rounded."""
    out, groups, gs = w.shape
    clipped = torch.minimum(torch.maximum(w, lo), hi).reshape(out, groups * gs)
    delta = (fake_quantize(clipped, config).reshape(w.shape) - w).transpose(0, 1)  # [g, out, gs]
    return ((delta @ gram) * delta).sum(-1).t()


def _best_symmetric_clip(w: torch.Tensor, gram: torch.Tensor, config: QuantConfig,
                         options: AWQOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max_val [out, g, 1], its error [out, g])``: AutoAWQ's search, ``max|w|`` shrunk in ``clip_grid`` steps."""
    n_steps = max(1, int(options.max_shrink * options.clip_grid))
    org_max = w.abs().amax(-1, keepdim=True)  # [out, g, 1]
    best_err = torch.full(w.shape[:2], float("inf"))
    best = org_max.clone()
    for i in range(n_steps):
        max_val = org_max * (1 - i / options.clip_grid)
        err = _clip_errors(w, gram, -max_val, max_val, config)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better[..., None], max_val, best)
    return best, best_err


@torch.no_grad()
def search_clip(weight: torch.Tensor, x: torch.Tensor, config: QuantConfig, options: AWQOptions) -> torch.Tensor:
    """Best ``max|w|`` per output channel and group ``[out, n_groups]`` for ``weight`` on inputs ``x [t, in]``.

    The error of a clipped group, ``mean_t (x_tg · (q_og - w_og))²``, is measured as ``Δ G_g Δᵀ`` with the
    group's Gram matrix ``G_g = mean_t x_tgᵀ x_tg`` (formed once): the same number as running the tokens through
    every candidate (AutoAWQ's way), at ``group_size`` instead of ``clip_tokens`` multiply-adds per weight.
    """
    w, gram = _clip_setup(weight, x, config, options)
    return _best_symmetric_clip(w, gram, config, options)[0].squeeze(-1)


@torch.no_grad()
def search_clip_range(weight: torch.Tensor, x: torch.Tensor, config: QuantConfig,
                      options: AWQOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)`` per output channel and group ``[out, n_groups]``: `search_clip`'s range, then its upper end and
    then its lower end each set alone to a step of the group's own max or min (the symmetric search's steps, toward
    0), a step kept where it lowers the group's error.

    AutoAWQ clips to ``[-m, m]``: on an asymmetric grid that shrinks only the side reaching ``m`` (or both), never
    the shorter side alone, though a skewed group may round better with its short tail clipped. Starting from the
    symmetric search's range, the measured error never rises."""
    w, gram = _clip_setup(weight, x, config, options)
    m, best_err = _best_symmetric_clip(w, gram, config, options)
    lo = torch.maximum(-m, w.amin(-1, keepdim=True))  # the range clamp(w, -m, m) leaves (the same error)
    hi = torch.minimum(m, w.amax(-1, keepdim=True))
    org_lo, org_hi = w.amin(-1, keepdim=True).clamp(max=0), w.amax(-1, keepdim=True).clamp(min=0)
    n_steps = max(1, int(options.max_shrink * options.clip_grid))
    for upper in (True, False):
        for i in range(n_steps):  # (i = 0: that end unclipped, which the symmetric range may have clipped)
            shrink = 1 - i / options.clip_grid
            candidate = (org_hi if upper else org_lo) * shrink
            err = _clip_errors(w, gram, *((lo, candidate) if upper else (candidate, hi)), config)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            if upper:
                hi = torch.where(better[..., None], candidate, hi)
            else:
                lo = torch.where(better[..., None], candidate, lo)
    return lo.squeeze(-1), hi.squeeze(-1)


def apply_clip(linear: nn.Linear, max_val: torch.Tensor, config: QuantConfig,
               min_val: torch.Tensor | None = None) -> None:
    """Clamp each group of ``linear``'s weight to ``[-max_val, max_val]``, or to ``[min_val, max_val]``."""
    w = linear.weight.data
    gs = config.resolve_group_size(w.shape[1])
    grouped = pad_to_groups(w, config).reshape(w.shape[0], -1, gs)
    hi = max_val.to(w)[..., None]
    lo = -hi if min_val is None else min_val.to(w)[..., None]
    w.copy_(torch.minimum(torch.maximum(grouped, lo), hi).reshape(w.shape[0], -1)[:, :w.shape[1]])


# ------------------------------------------------------------------------------------------- one block

@dataclasses.dataclass(frozen=True)
class _KVHeads:
    """GQA's layout of o's input: ``kv_heads * group`` query heads of ``head_dim`` channels, ``group`` per kv head
    (HF's ``repeat_kv``: query head h reads kv head h // group)."""

    kv_heads: int
    group: int
    head_dim: int

    def pool(self, s: torch.Tensor) -> torch.Tensor:  # o's input layout -> v's output layout (mean over the group)
        return s.reshape(self.kv_heads, self.group, self.head_dim).mean(1).reshape(-1)

    def expand(self, s_kv: torch.Tensor) -> torch.Tensor:  # v's output layout -> o's input layout
        return s_kv.reshape(self.kv_heads, 1, self.head_dim).expand(-1, self.group, -1).reshape(-1)

    def tie(self, s: torch.Tensor) -> torch.Tensor:
        return self.expand(self.pool(s))


def _kv_heads(block: nn.Module, v: nn.Linear, o: nn.Linear) -> _KVHeads | None:
    """o's input layout when v feeds it through GQA's head sharing; None when the block does not say its head
    size or the widths do not fit it (then v -> o is skipped)."""
    head_dim = getattr(getattr(block, "self_attn", None), "head_dim", None)
    if not head_dim or o.in_features % v.out_features or v.out_features % head_dim:
        return None
    return _KVHeads(v.out_features // head_dim, o.in_features // v.out_features, head_dim)


def _suffix(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _mlp_output(mlp: nn.Module, options: AWQOptions):
    """``inspect(x, [w_gate, w_up])``: the MLP's output for candidate gate/up weights (down and act as in ``mlp``).

    The one nonlinear group: every alpha runs the MLP on the search tokens (2/3 of the search's work). In bf16
    (``mlp_dtype``) each output moves by ~2^-9 relative, far below the rounding error the search compares."""
    dtype = torch.bfloat16 if options.mlp_dtype == "bf16" else torch.float32
    act, down = mlp.act_fn, mlp.down_proj.weight.detach().to(dtype)

    def inspect(xs, ws):
        xs = xs.to(dtype)
        return ((act(xs @ ws[0].to(dtype).t()) * (xs @ ws[1].to(dtype).t())) @ down.t()).float()
    return inspect


@torch.no_grad()
def awq_block(block: nn.Module, linears: dict[str, nn.Linear], collectors: dict[str, InputCollector],
              producers: dict[str, nn.Module], config: QuantConfig, options: AWQOptions,
              scales: dict[int, torch.Tensor] | None = None) -> dict[str, dict]:
    """Scale-search, fold and clip one decoder block's Linears in place (the float block stays equivalent up to
    the clipping). ``collectors`` hold each Linear's float inputs; ``producers`` maps a Linear's name to the
    norm module whose output is its input (found by the driver). Returns a report per scaling group; ``scales``
    (if given) receives, by ``id`` of each scaled Linear, the ``s`` its input is now divided by."""
    by_suffix = {_suffix(n): n for n in linears}
    # (group name, Linears, producer module, inspect module) in block order; a group is only used when whole
    groups = []
    qkv = [by_suffix[k] for k in ("q_proj", "k_proj", "v_proj") if k in by_suffix]
    if qkv and qkv[0] in producers:
        groups.append(("qkv", qkv, producers[qkv[0]], None))
    heads = None  # o's input layout under GQA (v -> o with shared scales)
    if "v_proj" in by_suffix and "o_proj" in by_suffix:
        v, o = linears[by_suffix["v_proj"]], linears[by_suffix["o_proj"]]
        # no GQA sharing (each o input is exactly one v output), or GQA's with shared scales (gqa_v_o)
        if v.out_features == o.in_features or (options.gqa_v_o and (heads := _kv_heads(block, v, o)) is not None):
            groups.append(("v->o", [by_suffix["o_proj"]], v, None))
    gate_up = [by_suffix[k] for k in ("gate_proj", "up_proj") if k in by_suffix]
    mlp = getattr(block, "mlp", None)
    if gate_up and gate_up[0] in producers:
        groups.append(("gate,up", gate_up, producers[gate_up[0]], mlp if len(gate_up) == 2 else None))
    if "up_proj" in by_suffix and "down_proj" in by_suffix:
        groups.append(("up->down", [by_suffix["down_proj"]], linears[by_suffix["up_proj"]], None))

    first = collectors[next(iter(collectors))].inputs[0]
    n_search = options.search_samples * first.shape[-2]  # search_samples sequences ([batch, seq, in] inputs)
    rows: dict[int, _SearchRows] = {}  # per distinct input (q,k,v share one): only the rows the searches read

    def inputs_of(name) -> _SearchRows:
        key = id(collectors[name].inputs[0])
        if key not in rows:
            rows[key] = _SearchRows(collectors[name], n_search, options.clip_tokens)
        return rows[key]

    report = {}
    for label, names, producer, inspect_module in groups:
        mods = [linears[n] for n in names]
        x = inputs_of(names[0])
        inspect = None if inspect_module is None else _mlp_output(inspect_module, options)
        shared = heads if label == "v->o" else None
        s, alpha, loss = search_scales(None, mods, config, options, x_search=x.search, inspect=inspect,
                                       x_mean=x.mean_abs, tie=None if shared is None else shared.tie)
        fold_scales(producer, mods, s, None if shared is None else shared.pool(s))
        x.div_(s)  # the Linears now read x / s (shared rows: once per input)
        if scales is not None:
            scales.update({id(m): s for m in mods})
        report[label] = {"alpha": alpha, "loss": loss}
    if options.clip:
        for name, lin in linears.items():
            if _suffix(name) in ("q_proj", "k_proj"):
                continue
            if options.clip_asym:
                lo, hi = search_clip_range(lin.weight, inputs_of(name).clip, config, options)
                apply_clip(lin, hi, config, min_val=lo)
            else:
                apply_clip(lin, search_clip(lin.weight, inputs_of(name).clip, config, options), config)
    return report


class AWQLayerQuantizer:
    """AWQ in the block driver's layer-quantizer protocol: inputs are collected, `prepare_block` runs the
    scale/clip search and folds, then each Linear is rounded: to nearest, or by ``rounding`` (a
    `toolkit.quant.layer_quantizers.GPTQLayerQuantizer`) under the Hessian of its scaled inputs."""

    needs_producers = True  # the driver records which norm output feeds which Linear

    def __init__(self, config: QuantConfig, options: AWQOptions = AWQOptions(), rounding=None,
                 scales_only: bool = False):
        self.config = config
        self.options = options
        self.rounding = rounding
        # True: search and fold scales (and clip, if on), round nothing: the driver leaves the weights float
        # (awq_rounding=gptq-sequential's first pass; GPTQ's own pass rounds the folded model after it)
        self.scales_only = scales_only
        self.last_report: dict = {}
        self._scales: dict[int, torch.Tensor] = {}  # id(Linear) -> s, this block's
        self._hessians: dict[tuple[int, int], object] = {}  # (id(collector), id(s)) -> HessianAccumulator

    def accumulator(self, linear: nn.Linear):
        return InputCollector()

    def prepare_block(self, block, linears, accumulators, producers) -> None:
        self._scales, self._hessians = {}, {}
        self.last_report = awq_block(block, linears, accumulators, producers, self.config, self.options,
                                     self._scales)

    def _scaled_hessian(self, linear: nn.Linear, collector: InputCollector):
        """GPTQ's Hessian of what ``linear`` reads after the fold, x / s: H(x) / (s sᵀ); one per collector and s
        (q,k,v share both: one Hessian for the three)."""

        s = self._scales.get(id(linear))
        key = (id(collector), id(s))
        if key not in self._hessians:
            acc = HessianAccumulator(linear.in_features)
            for x in collector.inputs:
                acc.add(x)
            if s is not None:
                inv = 1.0 / s.to(acc.hessian)
                acc.hessian.mul_(inv[:, None] * inv[None, :])
            self._hessians[key] = acc
        return self._hessians[key]

    def quantize(self, name: str, linear: nn.Linear, accumulator) -> QuantizedWeight:
        if self.rounding is None:
            return rtn_quantize(linear.weight, self.config, linear.bias)
        return self.rounding.quantize(name, linear, self._scaled_hessian(linear, accumulator))

    def quantize_together(self, linears: list[nn.Linear], accumulator) -> list[QuantizedWeight]:
        """Linears fed one tensor (q,k,v; gate,up), scaled by one s: GPTQ solves them as one stacked weight."""
        if self.rounding is None or len({id(self._scales.get(id(lin))) for lin in linears}) > 1:
            return [self.quantize("", lin, accumulator) for lin in linears]
        return self.rounding.quantize_together(linears, self._scaled_hessian(linears[0], accumulator))

    def fingerprint(self) -> dict:
        return {"method": "awq", "config": dataclasses.asdict(self.config),
                "options": dataclasses.asdict(self.options), "scales_only": self.scales_only,
                **({"rounding": self.rounding.fingerprint()} if self.rounding is not None else {})}
