"""Quantize a whole model, in two separate steps (the gpt-fast split):

1. `quantize_model(model, recipe)` makes a `QuantizedStateDict` — ``{module name: QuantizedWeight}`` for the
   decoder's Linear layers — and leaves the model untouched. That is what a checkpoint stores.
2. `swap_quantized_modules(model, qsd, factory)` replaces each of those Linear layers with the runtime module
   ``factory(qw)`` builds (``QuantLinear.from_quantized`` in practice; this file does not depend on it).

Which layers: every ``nn.Linear`` in the model except the output head (``lm_head``; embeddings are not Linear
layers, so they are never candidates), the names that match ``recipe.skip``, those outside ``recipe.modules``
(when given). A group size that does not divide ``in_features`` leaves a ragged last group (`QuantConfig.n_groups`),
not a skipped layer. Every Linear left in float is reported in ``QuantizedStateDict.skipped`` with the reason, never
dropped silently.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import sys
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from torch import nn

from toolkit.quant.primitives import QuantConfig
from toolkit.quant.quantized_weight import QuantizedWeight
from toolkit.quant.rtn import rtn_quantize

METHODS = ("rtn", "gptq", "awq")  # gptq and awq need calibration data
CALIB_DTYPES = ("fp32", "bf16", "auto")
AWQ_ROUNDINGS = ("rtn", "gptq", "gptq-sequential")
DEFAULT_SKIP = ("lm_head",)
# keys older versions recorded in a checkpoint's recipe and no longer has (always at these values in the shipped
# recipes): `QuantRecipe.from_dict` drops them, so those checkpoints still load
RETIRED_KEYS = ("block_size",)


@dataclasses.dataclass(frozen=True)
class Experimental:
    """Knobs no recipe sets, kept for the tests and the measured experiments in docs/notes (AWQ's; other methods
    ignore them). On the command line: ``quantize.experimental.<key>=...``."""

    awq_duo_scaling: bool = False  # AutoAWQ's duo_scaling: s = |x|^a / |w|^(1-a) instead of the paper's |x|^a
    awq_clip_grid: int = 20  # shrink steps of the clip search (AutoAWQ's n_grid there)
    awq_max_shrink: float = 0.5  # the clip search shrinks max|w| by at most this fraction
    awq_clip_tokens: int = 512  # tokens (evenly spaced over the calibration data) the clip search measures on
    # where block i + 1's calibration inputs come from: "float" (block i's float outputs, AutoAWQ's way: one
    # forward per block) or "quantized" (block i after scaling, clipping and rounding, as GPTQ does: a second
    # forward). Same quality on SmolLM2 (KL 0.123 vs 0.124), float 1.4x faster
    awq_next_inputs: str = "float"

    def __post_init__(self):
        if self.awq_next_inputs not in ("quantized", "float"):
            raise ValueError(f"QuantRecipe.experimental.awq_next_inputs must be quantized or float; "
                             f"got {self.awq_next_inputs!r}")


@dataclasses.dataclass(frozen=True)
class QuantRecipe:
    """What to quantize and how.

    ``skip`` and ``modules`` hold glob patterns (``fnmatch``, case-sensitive) matched against a module's full
    dotted name, or against any dotted tail of it: ``"lm_head"`` matches ``lm_head``, ``"mlp.down_proj"``
    matches ``model.layers.3.mlp.down_proj``, ``"model.layers.0.*"`` matches all of layer 0. ``modules=None``
    means every candidate; otherwise only names matching one of its patterns are quantized. The output head is
    never quantized, whatever ``skip`` says.
    """

    method: str = "rtn"
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    skip: tuple[str, ...] = DEFAULT_SKIP
    modules: tuple[str, ...] | None = None
    # GPTQ's knobs (IST-DASLab/gptq names); RTN ignores them
    damp_percent: float = 0.01
    act_order: bool = False
    static_groups: bool = False
    # GPTQ and RTN: choose each group's range by the reference quantizer's MSE grid search (Quantizer(mse=True))
    mse: bool = False
    # GPTQ: GPTAQ's asymmetric calibration (Li et al. 2025, GPTQModel's v2): fit each layer to the FLOAT model's
    # output from the inputs it gets through the quantized layers before it; the step's weight alpha (the paper's
    # 0.25; 1 = the full least-squares step), 0 = off (plain GPTQ). Costs one more float forward of each block and
    # the block's float layer inputs in memory
    gptaq_alpha: float = 0.0
    # GPTAQ: the step's Frobenius norm at most this times the weight's; a larger one is solved again with H's damping
    # raised x10 (up to 4 times), else dropped for that layer (plain GPTQ), with a warning. Normal steps are
    # 0.001-0.07 of the weight; an ill-conditioned H made one 3.3x (docs/notes/2026-12-quantization-methods-what-was-tried.md "AWQ scales, then GPTAQ")
    gptaq_max_step: float = 0.25
    # GPTQ: quantize a block's q,k,v | o | gate,up | down in turn, each on inputs through the quantized earlier ones
    true_sequential: bool = True
    # GPTQ, AWQ: the dtype the calibration forwards run in (block copies, activations; GPTQ's Hessians averaged in
    # fp32; AWQ's MLP candidates in the scale search too). "auto": bf16 where the CPU has native bf16 matmuls
    # (AVX512-BF16/AMX) or on CUDA, else fp32
    calib_dtype: str = "auto"
    # GPTQ, AWQ: calibration samples per block forward. 0 = all of them in one batch: true-sequential GPTQ then
    # quantizes each stage inside ONE forward of the block (a pre-hook solves q,k,v before they run, o before it
    # runs, ...), instead of a partial forward per stage plus an outputs pass. A positive number bounds the
    # activations' memory (roughly n_samples x seq_len x the MLP width, 4 tensors) at that cost.
    calib_batch: int = 0
    # AWQ's knobs (toolkit.quant.awq.AWQOptions, AutoAWQ names in comments); other methods ignore them
    awq_grid: int = 20  # n_grid: alphas i/grid tried in the scale search
    awq_coarse_step: int = 1  # 1: every alpha; s > 1: every s-th, then the best one's neighbours (AWQOptions)
    awq_clip: bool = True  # apply_clip: run the weight clip search
    awq_clip_asym: bool = False  # asymmetric grids: shrink each group's ends separately after the symmetric search
    awq_search_samples: int = 8  # calibration sequences the scale-search loss is measured on
    # v -> o under GQA too: one scale per v output, shared by the query heads that read its kv head (AutoAWQ: only
    # without GQA). SmolLM2, Qwen and Gemma 3 all use GQA, so without it their o_proj gets no scales
    awq_gqa_v_o: bool = False
    # how AWQ rounds the scaled, clipped weights: "rtn" (the paper's round-to-nearest), "gptq" (GPTQ's error
    # feedback under the scaled inputs' Hessian, with the GPTQ knobs above: damp_percent, act_order, ..., in the
    # same pass, each layer on its float sublayers' inputs) or "gptq-sequential" (two passes: AWQ's scale search
    # over the float model, scales folded and weights left float; then GPTQ's own true-sequential pass on that
    # equivalent model, GPTAQ included when gptaq_alpha > 0)
    awq_rounding: str = "rtn"
    # any method: after the codes are chosen, train each group's scale end to end (codes and zeros fixed) to lower
    # KL(float model || quantized model) on the calibration windows (toolkit.quant.scale_tuning; EfficientQAT's
    # E2E-QP with only the scales). Passes over the windows (0 = off), Adam's learning rate on log(scale), windows
    # per step. Costs a float copy of the model in RAM and about four forwards' work per window and pass (the float
    # model's forward, the quantized one's forward and backward)
    tune_scales_epochs: int = 0
    tune_scales_lr: float = 5e-4
    tune_scales_batch: int = 1
    # with scale tuning: the RMSNorm gains train too (float in every format; Norm Tweaking's idea)
    tune_norms: bool = False
    # calibration data for data-aware methods: windows from the calibration split of `dataset`
    dataset: str = "pydoc"
    n_samples: int = 128
    seq_len: int = 512
    # knobs no recipe sets (`Experimental`); a mapping of its keys is accepted too
    experimental: Experimental = Experimental()

    def __post_init__(self):
        if isinstance(self.experimental, dict):
            try:
                object.__setattr__(self, "experimental", Experimental(**self.experimental))
            except TypeError:
                known = [f.name for f in dataclasses.fields(Experimental)]
                raise ValueError(f"unknown QuantRecipe.experimental keys {sorted(set(self.experimental) - set(known))}"
                                 f"; known: {known}") from None
        elif not isinstance(self.experimental, Experimental):
            raise TypeError(f"QuantRecipe.experimental must be a mapping of {Experimental.__name__}'s keys; "
                             f"got {self.experimental!r}")
        if self.method not in METHODS:
            raise ValueError(f"QuantRecipe.method must be one of {', '.join(METHODS)}; got {self.method!r}")
        QuantConfig(bits=self.bits, group_size=self.group_size, symmetric=self.symmetric)  # validates, or raises
        if self.calib_dtype not in CALIB_DTYPES:
            raise ValueError(f"QuantRecipe.calib_dtype must be one of {', '.join(CALIB_DTYPES)}; "
                             f"got {self.calib_dtype!r}")
        if self.awq_rounding not in AWQ_ROUNDINGS:
            raise ValueError(f"QuantRecipe.awq_rounding must be one of {', '.join(AWQ_ROUNDINGS)}; "
                             f"got {self.awq_rounding!r}")
        if self.gptaq_alpha < 0:
            raise ValueError(f"QuantRecipe.gptaq_alpha must be >= 0 (0 = plain GPTQ, 0.25 = GPTAQ's); "
                             f"got {self.gptaq_alpha}")
        if not self.gptaq_max_step > 0:
            raise ValueError(f"QuantRecipe.gptaq_max_step must be > 0 (the GPTAQ step's largest norm relative to the "
                             f"weight's; 0.25 by default); got {self.gptaq_max_step}")
        if self.gptaq_alpha > 0 and not self.gptq_pass:
            raise ValueError(f"QuantRecipe.gptaq_alpha (GPTAQ's asymmetric calibration) applies to method=gptq or "
                             f"to method=awq with awq_rounding=gptq-sequential; this recipe is method={self.method}"
                             f"{', awq_rounding=' + self.awq_rounding if self.method == 'awq' else ''}: set "
                             f"gptaq_alpha=0 or one of those (awq_rounding=gptq quantizes a block's layers on its "
                             f"float sublayers' outputs, not true-sequentially, so each layer would correct the "
                             f"same drift again)")
        if self.gptaq_alpha > 0 and not self.true_sequential:
            raise ValueError("QuantRecipe.gptaq_alpha needs true_sequential=true: each layer's correction assumes the "
                             "layers before it in the block are already quantized (and corrected); with one stage, "
                             "o, gate/up and down would correct the drift q,k,v already corrected")
        if self.awq_clip_asym and self.symmetric:
            raise ValueError("QuantRecipe.awq_clip_asym shrinks a group's two ends separately, which a symmetric grid "
                             "cannot follow (its range is mirrored): set symmetric=false or awq_clip_asym=false")
        if self.tune_norms and not self.tune_scales_epochs:
            raise ValueError("QuantRecipe.tune_norms trains the norms beside the scales: set tune_scales_epochs >= 1 "
                             "too, or tune_norms=false")
        if self.tune_scales_epochs < 0 or self.tune_scales_batch < 1 or not self.tune_scales_lr > 0:
            raise ValueError(f"QuantRecipe: scale tuning needs tune_scales_epochs >= 0 (0 = off), tune_scales_batch >= "
                             f"1 and tune_scales_lr > 0; got {self.tune_scales_epochs}, {self.tune_scales_batch}, "
                             f"{self.tune_scales_lr}")
        if self.calib_batch < 0:
            raise ValueError(f"QuantRecipe.calib_batch must be >= 0 (0 = all samples in one forward); "
                             f"got {self.calib_batch}")
        object.__setattr__(self, "skip", _patterns(self.skip, "skip"))
        if self.modules is not None:
            object.__setattr__(self, "modules", _patterns(self.modules, "modules"))

    @property
    def gptq_pass(self) -> bool:
        """Whether GPTQ's own true-sequential blockwise pass quantizes (method gptq, or AWQ's second pass)."""
        return self.method == "gptq" or (self.method == "awq" and self.awq_rounding == "gptq-sequential")

    @property
    def config(self) -> QuantConfig:
        return QuantConfig(bits=self.bits, group_size=self.group_size, symmetric=self.symmetric)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["skip"] = list(self.skip)
        d["modules"] = None if self.modules is None else list(self.modules)
        return d

    @classmethod
    def from_dict(cls, d: dict, *, retired_ok: bool = True) -> QuantRecipe:
        """A recipe from `to_dict`'s mapping, or an older version's: its flat `Experimental` keys
        (``awq_clip_grid``, ...) go into ``experimental``, and (``retired_ok``) the `RETIRED_KEYS` are dropped."""
        d = dict(d)
        experimental = dict(d.pop("experimental", None) or {})
        for name in [f.name for f in dataclasses.fields(Experimental)]:
            if name in d:
                experimental.setdefault(name, d.pop(name))
        if retired_ok:
            for name in RETIRED_KEYS:
                d.pop(name, None)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"unknown QuantRecipe keys {sorted(unknown)}; known: {sorted(fields)}")
        return cls(**d, experimental=experimental)


def _patterns(value, what: str) -> tuple[str, ...]:
    if isinstance(value, str):  # a lone string would otherwise become a tuple of characters
        value = (value,)
    try:
        patterns = tuple(value)
    except TypeError:
        raise ValueError(f"QuantRecipe.{what} must be a list of module-name patterns, got {value!r}") from None
    if not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"QuantRecipe.{what} must hold non-empty strings, got {value!r}")
    return patterns


def matches(name: str, patterns: Iterable[str]) -> str | None:
    """The first pattern that matches ``name`` (whole dotted name or a dotted tail of it), else None."""
    for pattern in patterns:
        if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern):
            return pattern
    return None


class SkippedModule(NamedTuple):
    """A Linear layer left in float, and why. Unpacks as ``name, reason``."""

    name: str
    reason: str


@dataclasses.dataclass
class QuantizedStateDict:
    """The result of `quantize_model`: the quantized Linear weights by module name, and what was left in float.

    ``errors`` holds each layer's relative Frobenius error ``||W - deq(Q)|| / ||W||`` (a checkpoint keeps them).
    """

    weights: dict[str, QuantizedWeight]
    recipe: QuantRecipe
    skipped: list[SkippedModule] = dataclasses.field(default_factory=list)
    errors: dict[str, float] = dataclasses.field(default_factory=dict)
    # where the calibrating driver's time went, seconds by phase (not saved in checkpoints)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    # scale tuning's report (toolkit.quant.scale_tuning.tune_scales), when the recipe tuned the scales
    tuning: dict | None = None

    def __len__(self) -> int:
        return len(self.weights)

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def __getitem__(self, name: str) -> QuantizedWeight:
        return self.weights[name]


def _output_head_names(model: nn.Module) -> set[str]:
    """Names of the module(s) that are the model's output head: ``get_output_embeddings()``, else ``lm_head``."""
    head = None
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except (AttributeError, NotImplementedError):
            head = None
    names = {"lm_head"}
    if head is not None:
        names |= {name for name, module in model.named_modules(remove_duplicate=False) if module is head}
    return names


def quantizable_linears(model: nn.Module, recipe: QuantRecipe) -> tuple[dict[str, nn.Linear], list[SkippedModule]]:
    """``(linears, skipped)``: the ``nn.Linear`` layers `quantize_model` will quantize, by name in model order,
    and every other ``nn.Linear`` with the reason it stays in float. Together they list each Linear once."""
    config = recipe.config
    heads = _output_head_names(model)
    linears: dict[str, nn.Linear] = {}
    skipped: list[SkippedModule] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if name in heads:
            skipped.append(SkippedModule(name, "output head (always kept in float)"))
        elif (pattern := matches(name, recipe.skip)) is not None:
            skipped.append(SkippedModule(name, f"matches skip pattern {pattern!r}"))
        elif recipe.modules is not None and matches(name, recipe.modules) is None:
            skipped.append(SkippedModule(name, "matches none of the recipe's modules patterns"))
        elif module.weight.device.type == "meta" and not _offloaded(module):
            skipped.append(SkippedModule(name, "weight is on the meta device (not loaded)"))
        else:
            try:
                config.resolve_group_size(module.in_features)
            except ValueError as exc:
                skipped.append(SkippedModule(name, str(exc)))
                continue
            linears[name] = module
    return linears, skipped


def _offloaded(module: nn.Module) -> bool:
    """accelerate keeps this module's weight on disk (meta here) and loads it per forward: still quantizable."""
    hook = getattr(module, "_hf_hook", None)
    return bool(getattr(hook, "offload", False)) and getattr(hook, "weights_map", None) is not None


_ALGORITHMS: dict[str, Callable[..., QuantizedWeight]] = {
    "rtn": rtn_quantize,
}


def relative_error(weight: torch.Tensor, qw: QuantizedWeight) -> float:
    """``||W - deq(Q)||_F / ||W||_F`` in float32 (0 for an all-zero weight quantized exactly)."""
    w = weight.detach().to(torch.float32)
    diff = torch.linalg.matrix_norm(w - qw.dequantize(torch.float32).to(w.device))
    norm = torch.linalg.matrix_norm(w)
    return float(diff / norm) if norm > 0 else float(diff)


@torch.no_grad()
def quantize_model(model: nn.Module, recipe: QuantRecipe, progress: bool = True) -> QuantizedStateDict:
    """Quantize the model's Linear layers (see `quantizable_linears`) with ``recipe``; the model is not modified.

    The QuantizedWeights live on each weight's device. A progress bar (stderr) shows each layer's relative error.
    """
    from tqdm import tqdm

    linears, skipped = quantizable_linears(model, recipe)
    algorithm = _ALGORITHMS[recipe.method]
    config = recipe.config
    weights: dict[str, QuantizedWeight] = {}
    errors: dict[str, float] = {}
    with tqdm(linears.items(), desc=f"{recipe.method} int{recipe.bits}", unit="layer", disable=not progress,
              file=sys.stderr, dynamic_ncols=True) as bar:
        for name, linear in bar:
            qw = algorithm(linear.weight, config, linear.bias, mse=recipe.mse)
            weights[name] = qw
            errors[name] = relative_error(linear.weight, qw)
            bar.set_postfix_str(f"{name} rel_err={errors[name]:.4f}", refresh=False)
    return QuantizedStateDict(weights=weights, recipe=recipe, skipped=skipped, errors=errors)


def swap_quantized_modules(model: nn.Module, qsd: QuantizedStateDict | dict[str, QuantizedWeight],
                           module_factory: Callable[[QuantizedWeight], nn.Module]) -> nn.Module:
    """Replace each ``nn.Linear`` named in ``qsd`` with ``module_factory(qw)``, in place; returns ``model``.

    Checks every target first (exists, is an ``nn.Linear`` of the QuantizedWeight's shape), so a mismatch
    leaves the model unchanged. The factory decides device and dtype of the new module.
    """
    weights = qsd.weights if isinstance(qsd, QuantizedStateDict) else qsd
    targets = []
    for name, qw in weights.items():
        parent_name, _, child = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
            old = getattr(parent, child)
        except AttributeError:
            raise ValueError(f"the model has no module {name!r} to swap (wrong model for this checkpoint?)") from None
        if not isinstance(old, nn.Linear):
            raise ValueError(f"module {name!r} is a {type(old).__name__}, not an nn.Linear")
        if (old.out_features, old.in_features) != (qw.out_features, qw.in_features):
            raise ValueError(f"module {name!r} is Linear({old.in_features} -> {old.out_features}) but the quantized "
                             f"weight is [{qw.out_features}, {qw.in_features}] (wrong model for this checkpoint?)")
        targets.append((parent, child, qw))
    for parent, child, qw in targets:
        setattr(parent, child, module_factory(qw))
    return model
