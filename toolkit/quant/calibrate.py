"""The one entry point for `specquant quantize` (`make_quantized_state_dict`): RTN needs no data; GPTQ and AWQ
calibrate block by block (`toolkit.quant.blockwise`, on `toolkit.quant.calibration_data` windows, with a layer
quantizer from `toolkit.quant.layer_quantizers`); ``awq_rounding=gptq-sequential`` runs AWQ's scales pass, then
GPTQ's; scale tuning runs last."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from toolkit.fileio import save_torch_atomic
from toolkit.quant.awq import AWQLayerQuantizer
from toolkit.quant.block_passes import decoder_blocks
from toolkit.quant.blockwise import (
    model_fingerprint,
    quantize_blockwise,
    without_tuning,
)
from toolkit.quant.calibration_data import calibration_batches
from toolkit.quant.layer_quantizers import (
    GPTQLayerQuantizer,
    RTNLayerQuantizer,
    awq_options,
    calibration_dtype,
    forward_dtype,
    layer_quantizer_for,
)
from toolkit.quant.model_quant import QuantizedStateDict, QuantRecipe, quantize_model
from toolkit.quant.offload import has_offloaded
from toolkit.quant.scale_tuning import ScaleTuneOptions, tune_scales

__all__ = ["fold_awq_scales", "make_quantized_state_dict"]


def make_quantized_state_dict(model: nn.Module, tokenizer, recipe: QuantRecipe, progress: bool = True,
                              state_dir: str | os.PathLike | None = None) -> QuantizedStateDict:
    """The one entry point for `specquant quantize`: RTN needs no data; GPTQ and AWQ calibrate block by block;
    with ``recipe.tune_scales_epochs`` the scales the method chose are then tuned end to end (`_tune_scales`).

    The recipe the result carries (and the checkpoint's manifest records) names the calibration dtype the run
    used: ``calib_dtype=auto`` becomes bf16 or fp32; fp32 for the methods and offloaded models that never use bf16.
    """
    device = next(model.parameters()).device
    offloaded = has_offloaded(model)
    bf16 = forward_dtype(recipe, offloaded, device) is not None
    recipe = dataclasses.replace(recipe, calib_dtype="bf16" if bf16 else "fp32")
    teacher = None
    if recipe.tune_scales_epochs:
        if offloaded:
            raise ValueError("tune_scales_epochs trains the scales through the whole model beside a float copy of it, "
                             "so it cannot run on an offloaded model (max_memory); set tune_scales_epochs=0, or load "
                             "the model into RAM")
        teacher = copy.deepcopy(model).eval()  # the float model, before any fold or rounding touches it
    if recipe.method == "rtn" and offloaded:  # walked block by block; RTN needs just one short window
        batches = calibration_batches(tokenizer, recipe.dataset, 1, 16)
        return quantize_blockwise(model, recipe, batches, RTNLayerQuantizer(recipe.config, recipe.mse),
                                  progress=progress)
    batches = None
    if recipe.method != "rtn" or teacher is not None:
        batches = calibration_batches(tokenizer, recipe.dataset, recipe.n_samples, recipe.seq_len)
    if recipe.method == "rtn":
        qsd = quantize_model(model, recipe, progress=progress)
    elif recipe.method == "awq" and recipe.awq_rounding == "gptq-sequential":
        qsd = _awq_then_gptq(model, recipe, batches, device, progress, state_dir)
    else:
        qsd = quantize_blockwise(model, recipe, batches, layer_quantizer_for(recipe, device), progress=progress,
                                 state_dir=state_dir)
    if teacher is not None:
        qsd = _tune_scales(model, teacher, qsd, batches, recipe, device, progress, state_dir)
    return qsd


def _tune_scales(model: nn.Module, teacher: nn.Module, qsd: QuantizedStateDict, batches: torch.Tensor,
                 recipe: QuantRecipe, device, progress: bool, state_dir) -> QuantizedStateDict:
    """The method's codes and zeros kept, its scales trained to lower KL(teacher || model) on ``batches``."""

    options = ScaleTuneOptions(epochs=recipe.tune_scales_epochs, lr=recipe.tune_scales_lr,
                               batch=recipe.tune_scales_batch, dtype=calibration_dtype(recipe, device),
                               norms=recipe.tune_norms)
    state_path = None
    if state_dir is not None:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        state_path = Path(state_dir) / "scale_tune.pt"
    weights, report = tune_scales(model, teacher, qsd.weights, batches, options, progress=progress,
                                  state_path=state_path)
    return dataclasses.replace(qsd, weights=weights, tuning=report,
                               timings={**qsd.timings, "scale tuning": report["seconds"]})


def _awq_then_gptq(model: nn.Module, recipe: QuantRecipe, batches: torch.Tensor, device, progress: bool,
                   state_dir) -> QuantizedStateDict:
    """``awq_rounding=gptq-sequential``: AWQ's scale search over the float model (every block on the float
    model's hidden states, scales folded into norms and Linears, nothing rounded: an equivalent float model),
    then GPTQ's own true-sequential pass (GPTAQ included) on it. GPTQ then rounds weights whose activation-heavy
    input channels AWQ has scaled up, and each layer sees the quantized layers before it, which the one-pass
    ``awq_rounding=gptq`` cannot give it. With ``state_dir`` the folded blocks are kept there, so a resumed run
    skips the first pass and the second resumes from its last finished block."""
    if has_offloaded(model):
        raise ValueError("awq_rounding=gptq-sequential folds AWQ's scales into the whole float model before GPTQ "
                         "runs, so it cannot run on an offloaded model (max_memory); use awq_rounding=gptq, or "
                         "load the model into RAM")
    _, blocks = decoder_blocks(model)
    first = _fold_recipe(recipe)
    options = awq_options(recipe, device)
    folded = None
    if state_dir is not None:
        folded = Path(state_dir) / "awq_folded.pt"
        Path(state_dir).mkdir(parents=True, exist_ok=True)
    record = {"recipe": first.to_dict(), "model": model_fingerprint(model), "options": dataclasses.asdict(options),
              "batches_sha256": hashlib.sha256(batches.cpu().numpy().tobytes()).hexdigest()}
    timings: dict[str, float] = {}
    if folded is not None and folded.exists():
        saved = torch.load(folded, weights_only=True)
        if saved["record"] != json.dumps(record, sort_keys=True):
            raise ValueError(f"{folded} belongs to a different run (recipe, model or data differ); use another "
                             f"state_dir or delete it")
        blocks.load_state_dict(saved["blocks"])
    else:
        scaled = fold_awq_scales(model, recipe, batches, device, progress)
        timings.update({f"AWQ pass: {k}": v for k, v in scaled.timings.items()})
        if folded is not None:
            save_torch_atomic({"record": json.dumps(record, sort_keys=True), "blocks": blocks.state_dict()}, folded)
    result = quantize_blockwise(model, recipe, batches, GPTQLayerQuantizer(recipe), progress=progress,
                                state_dir=state_dir)
    timings.update({f"GPTQ pass: {k}": v for k, v in result.timings.items()})
    return dataclasses.replace(result, timings=timings)


def _fold_recipe(recipe: QuantRecipe) -> QuantRecipe:
    """The recipe of AWQ's scales-only pass: AWQ's own knobs; GPTQ's and the tuning's at their defaults (a resumed
    run that changes only them reuses the fold); each block searched on the float block's outputs (with nothing
    rounded there are no quantized outputs to take)."""
    gptq_only = ("damp_percent", "act_order", "static_groups", "mse", "gptaq_alpha", "gptaq_max_step")
    defaults = {f.name: f.default for f in dataclasses.fields(QuantRecipe) if f.name in gptq_only}
    experimental = dataclasses.replace(recipe.experimental, awq_next_inputs="float")
    return without_tuning(dataclasses.replace(recipe, experimental=experimental, **defaults))


def fold_awq_scales(model: nn.Module, recipe: QuantRecipe, batches: torch.Tensor, device="cpu",
                    progress: bool = True) -> QuantizedStateDict:
    """AWQ with nothing rounded: every block's scales searched and folded, its clips applied, in place; the model
    stays float (an equivalent model but for the clips). Returns the pass's result (no weights; its timings)."""
    return quantize_blockwise(model, _fold_recipe(recipe), batches,
                              AWQLayerQuantizer(recipe.config, awq_options(recipe, device), scales_only=True),
                              progress=progress)

