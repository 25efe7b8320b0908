"""Layer quantizers, the blockwise driver's protocol (`toolkit.quant.blockwise`): RTN, GPTQ and (from
`toolkit.quant.awq`) AWQ; which one a recipe's method uses; and the dtype their calibration forwards run in."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from toolkit import cpu
from toolkit.quant.awq import AWQLayerQuantizer, AWQOptions
from toolkit.quant.gptq import HessianAccumulator, gptq_quantize
from toolkit.quant.model_quant import QuantRecipe
from toolkit.quant.primitives import QuantConfig
from toolkit.quant.quantized_weight import QuantizedWeight
from toolkit.quant.rtn import rtn_quantize

__all__ = ["GPTQLayerQuantizer", "RTNLayerQuantizer", "awq_options", "calibration_dtype", "forward_dtype",
           "layer_quantizer_for"]

BF16_METHODS = ("gptq", "awq")  # the methods whose calibration forwards may run in bf16 (calib_dtype)


class RTNLayerQuantizer:
    """Round-to-nearest in the layer-quantizer protocol: no accumulator (no data), `rtn_quantize` the weight."""

    def __init__(self, config: QuantConfig, mse: bool = False):
        self.config = config
        self.mse = mse

    def accumulator(self, linear: nn.Linear):
        return None

    def quantize(self, name: str, linear: nn.Linear, accumulator) -> QuantizedWeight:
        return rtn_quantize(linear.weight, self.config, linear.bias, mse=self.mse)

    def fingerprint(self) -> dict:
        return {"method": "rtn", "config": dataclasses.asdict(self.config), "mse": self.mse}


class GPTQLayerQuantizer:
    """GPTQ in the layer-quantizer protocol: a Hessian of each layer's inputs, then `gptq_quantize`."""

    def __init__(self, recipe: QuantRecipe):
        self.recipe = recipe
        # GPTAQ: the driver runs each block in float first and sets, per Linear (by id), its float inputs
        self.needs_float_inputs = recipe.gptaq_alpha > 0
        self.float_inputs: dict[int, torch.Tensor] = {}

    def accumulator(self, linear: nn.Linear):
        # flattens [..., in] inputs to rows itself; with GPTAQ also averages (x_float - x) xᵀ
        return HessianAccumulator(linear.in_features, float_inputs=self.float_inputs.get(id(linear)))

    def quantize(self, name: str, linear: nn.Linear, accumulator) -> QuantizedWeight:
        r = self.recipe
        qw, _loss = gptq_quantize(linear.weight, accumulator.hessian, r.config, damp_percent=r.damp_percent,
                                  act_order=r.act_order, static_groups=r.static_groups,
                                  mse=r.mse, bias=linear.bias, delta_xxt=accumulator.delta_xxt,
                                  asym_alpha=r.gptaq_alpha, asym_max_step=r.gptaq_max_step)
        return qw

    def quantize_together(self, linears: list[nn.Linear], accumulator) -> list[QuantizedWeight]:
        """Layers fed the same input (one Hessian: q,k,v; gate,up) solved as ONE stacked weight: GPTQ treats each
        output row on its own given H, so the codes are the separate solves' (tested), in one column loop."""
        r = self.recipe
        stacked = torch.cat([lin.weight for lin in linears])
        qw, _loss = gptq_quantize(stacked, accumulator.hessian, r.config, damp_percent=r.damp_percent,
                                  act_order=r.act_order, static_groups=r.static_groups,
                                  mse=r.mse, delta_xxt=accumulator.delta_xxt, asym_alpha=r.gptaq_alpha,
                                  asym_max_step=r.gptaq_max_step)
        parts, start = [], 0
        for lin in linears:
            rows = slice(start, start + lin.out_features)
            start += lin.out_features
            parts.append(QuantizedWeight(codes=qw.codes[rows].clone(), scale=qw.scale[rows].clone(),
                                         zero=qw.zero[rows].clone(), config=qw.config,
                                         bias=None if lin.bias is None else lin.bias.detach().clone(),
                                         g_idx=None if qw.g_idx is None else qw.g_idx.clone()))
        return parts

    def fingerprint(self) -> dict:
        r = self.recipe
        return {"method": "gptq", "config": dataclasses.asdict(r.config), "damp_percent": r.damp_percent,
                "act_order": r.act_order, "static_groups": r.static_groups, "mse": r.mse,
                "gptaq_alpha": r.gptaq_alpha, "gptaq_max_step": r.gptaq_max_step}


def layer_quantizer_for(recipe: QuantRecipe, device="cpu"):
    """The layer quantizer (driver protocol) a recipe's method uses (one pass; ``awq_rounding=gptq-sequential``
    runs two, `make_quantized_state_dict`)."""
    if recipe.method == "awq" and recipe.awq_rounding == "gptq-sequential":
        raise ValueError("awq_rounding=gptq-sequential runs two passes (AWQ's scales, then GPTQ); call "
                         "make_quantized_state_dict, not one layer quantizer")
    if recipe.method == "gptq":
        return GPTQLayerQuantizer(recipe)
    if recipe.method == "awq":
        return AWQLayerQuantizer(recipe.config, awq_options(recipe, device),
                                 GPTQLayerQuantizer(recipe) if recipe.awq_rounding == "gptq" else None)
    return RTNLayerQuantizer(recipe.config, recipe.mse)


def awq_options(recipe: QuantRecipe, device="cpu") -> AWQOptions:
    """AWQOptions from a recipe; the MLP candidates of the scale search run in the calibration dtype."""
    mlp_dtype = "bf16" if calibration_dtype(recipe, device) is torch.bfloat16 else "fp32"
    x = recipe.experimental
    return AWQOptions(grid=recipe.awq_grid, coarse_step=recipe.awq_coarse_step, duo_scaling=x.awq_duo_scaling,
                      clip=recipe.awq_clip, clip_grid=x.awq_clip_grid, max_shrink=x.awq_max_shrink,
                      clip_tokens=x.awq_clip_tokens, clip_asym=recipe.awq_clip_asym,
                      search_samples=recipe.awq_search_samples, mlp_dtype=mlp_dtype, gqa_v_o=recipe.awq_gqa_v_o)


def calibration_dtype(recipe: QuantRecipe, device) -> torch.dtype | None:
    """The dtype GPTQ's calibration forwards run in, or None for the model's own (fp32).

    bf16 halves the activations' memory and, where the hardware multiplies bf16 natively (AVX512-BF16 or AMX on
    the CPU, any CUDA GPU), runs the forwards' GEMMs 2-3x faster than fp32 (AutoGPTQ and GPTQModel calibrate in
    the model's fp16/bf16 the same way). The weights GPTQ quantizes stay fp32, and the Hessian is an fp32 average
    of per-batch bf16 products (`HessianAccumulator.add`).
    """
    choice = recipe.calib_dtype
    if choice == "auto":
        native = torch.device(device).type == "cuda" or cpu.native_bf16()
        choice = "bf16" if native else "fp32"
    return torch.bfloat16 if choice == "bf16" else None


def forward_dtype(recipe: QuantRecipe, offloaded: bool, device) -> torch.dtype | None:
    """The dtype of a run's calibration forwards, or None for the model's own. GPTQ and AWQ may run them on a bf16
    copy of each block (`calibration_dtype`; AWQ folds and clips the fp32 block itself, then takes a fresh copy
    for an outputs pass); an offloaded block is accelerate's to move, and RTN needs no data: those stay as they
    are. Scale tuning's forwards (any method) run in it too."""
    if (recipe.method not in BF16_METHODS and not recipe.tune_scales_epochs) or offloaded:
        return None
    return calibration_dtype(recipe, device)
