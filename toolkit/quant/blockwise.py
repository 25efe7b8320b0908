"""The block-by-block driver that data-dependent quantizers (GPTQ, AWQ) run in.

`quantize_blockwise` walks the decoder blocks one at a time over calibration windows
(`toolkit.quant.calibration_data`), with the passes of `toolkit.quant.block_passes`:

1. Capture the inputs of decoder block 0 (one ``[1, seq_len, hidden]`` tensor per sample) and the keyword
   arguments *every* block receives (attention mask, position embeddings, position ids, ...). Blocks may get
   different kwargs (Gemma 3: sliding vs full attention masks, local vs global rotary embeddings), so the
   capture pass hooks every block (forward pre-hook ``with_kwargs=True``), replaces each block's ``forward``
   by the identity for that pass (nothing is computed) and stops the model by raising a private exception
   at the last block. The kwargs are taken from the first sample: all windows have the same length and no
   padding, so they are the same for every sample.
2. For each block ``i``, its quantizable Linear layers in *stages* (`quantization_stages`): with
   ``recipe.true_sequential`` (GPTQ's default) q,k,v | o | gate,up | down, else one stage. For each stage the block runs over all inputs
   with forward pre-hooks feeding each layer's input into ``layer_quantizer.accumulator(linear)`` (layers fed
   the very same tensor share one accumulator: one Hessian for q,k,v, not three); a stage that is not the
   last stops the forward once its layers have their inputs. Each layer is quantized with
   ``layer_quantizer.quantize(name, linear, accumulator)`` and its dequantized weight written into the Linear
   at once, so later stages see their inputs through the already-quantized sublayers (true sequential).
   A quantizer with ``prepare_block`` (AWQ) gets the block, its Linears, accumulators and the norm feeding each
   Linear first (scale search and fold); it always runs as one stage, since it folds scales into v/up.
   Then the block runs again to produce the inputs of block ``i + 1`` from the *quantized* block (GPTQ's
   sequential-across-blocks scheme), or, for AWQ with ``experimental.awq_next_inputs="float"`` (the default), the
   statistics forward's own (float) outputs are those inputs (AutoAWQ's scheme).
3. With every sample in one batch (``recipe.calib_batch == 0``, the default) a true-sequential block needs no
   stages: `quantize_in_one_forward` hooks the first Linear of each input group, and in ONE forward of the
   batch each hook builds its group's statistics, quantizes the group and writes the weights before the Linear
   runs; the forward's output is the next block's input. ``calib_batch = N`` batches N samples per forward and
   takes the staged path above (bounded activation memory, ~3.4 forwards a block instead of one).

Peak memory is about one block plus the activations (``n_samples`` hidden states, twice, and with one batch the
block's intermediate activations for all samples).

**The model is modified**: its quantized Linear weights end up dequantized-quantized (a fake-quant float
model, handy for evaluating quality). The returned `QuantizedStateDict` is the real output.

Layer-quantizer protocol (two methods)::

    accumulator(linear: nn.Linear) -> object | None
        # a fresh per-layer statistics collector with ``add(x)`` (x: the layer's input, [..., in_features],
        # detached), e.g. GPTQ's HessianAccumulator; None if the method needs no data (RTN: no hook at all)
    quantize(name: str, linear: nn.Linear, accumulator) -> QuantizedWeight
        # quantize ``linear.weight`` (still float) given what the accumulator saw

Resumability: with ``state_dir``, after each block the driver saves that block's QuantizedWeights and the next
block's inputs (one ``[n_samples, seq_len, hidden]`` tensor; ``torch.save`` to a temporary file, then
``os.replace``) and a JSON progress record (recipe, model fingerprint, calibration-data hash, quantizer, blocks
done). Restarting with the same ``state_dir`` and a matching record restores the finished blocks (their fake-quant
weights go back into the model) and carries on from the first unfinished one; a record that does not match raises
rather than mixing runs.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

from toolkit.fileio import save_torch_atomic
from toolkit.quant.block_passes import (
    PhaseTimer,
    batched,
    capture_inputs,
    collect_statistics,
    decoder_blocks,
    quantization_stages,
    quantize_in_one_forward,
    quantize_sharing,
    run_block,
    run_float_pass,
)
from toolkit.quant.layer_quantizers import GPTQLayerQuantizer, forward_dtype
from toolkit.quant.model_quant import (
    QuantizedStateDict,
    QuantRecipe,
    SkippedModule,
    quantizable_linears,
    relative_error,
)
from toolkit.quant.offload import has_offloaded, onload, release
from toolkit.quant.primitives import QuantConfig
from toolkit.quant.quantized_weight import QuantizedWeight

__all__ = ["model_fingerprint", "quantize_blockwise", "without_tuning"]

_STATE_VERSION = 2  # 2: the next block's inputs saved as one [n_samples, seq_len, hidden] tensor


def _cast_floats(value, dtype: torch.dtype):
    """``value`` with every floating-point tensor in it (nested in tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


def _runner(block: nn.Module, block_linears: dict[str, nn.Linear], dtype: torch.dtype | None):
    """``(module that runs the forwards, its Linears under the block's names)``: the block itself, or a copy in
    ``dtype`` (the block keeps its fp32 weights, which are what GPTQ quantizes)."""
    if dtype is None:
        return block, block_linears
    copy_ = copy.deepcopy(block).to(dtype)
    by_module = {id(module): name for name, module in block.named_modules()}
    return copy_, {name: copy_.get_submodule(by_module[id(lin)]) for name, lin in block_linears.items()}


def model_fingerprint(model) -> dict:
    config = getattr(model, "config", None)
    text = config.to_json_string(use_diff=False) if config is not None and hasattr(config, "to_json_string") else ""
    return {"class": type(model).__name__, "name": getattr(config, "name_or_path", None) or "",
            "config_sha256": hashlib.sha256(text.encode()).hexdigest()}


def _qw_to_dict(qw: QuantizedWeight) -> dict:
    return {"codes": qw.codes.cpu(), "scale": qw.scale.cpu(), "zero": qw.zero.cpu(),
            "bias": None if qw.bias is None else qw.bias.cpu(),
            "g_idx": None if qw.g_idx is None else qw.g_idx.cpu(), "config": dataclasses.asdict(qw.config)}


def _qw_from_dict(d: dict, device) -> QuantizedWeight:
    def to(t):
        return None if t is None else t.to(device)
    return QuantizedWeight(codes=to(d["codes"]), scale=to(d["scale"]), zero=to(d["zero"]),
                           config=QuantConfig(**d["config"]), bias=to(d["bias"]), g_idx=to(d["g_idx"]))


def _atomic_json(obj, path: Path):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _set_weight(linear: nn.Linear, qw: QuantizedWeight):
    linear.weight.data.copy_(qw.dequantize(torch.float32).to(device=linear.weight.device,
                                                             dtype=linear.weight.dtype))


@torch.no_grad()
def quantize_blockwise(model: nn.Module, recipe: QuantRecipe, batches: torch.Tensor, layer_quantizer,
                       progress: bool = True, state_dir: str | os.PathLike | None = None) -> QuantizedStateDict:
    """Quantize the decoder blocks' Linear layers one block at a time on calibration ``batches`` [n, seq_len].

    See the module docstring for the scheme, the layer-quantizer protocol and resuming from ``state_dir``.
    Quantizable Linear layers outside the decoder blocks are left in float and listed in ``skipped``.
    The model's quantized Linear weights are left fake-quantized (dequantized codes) on return.
    """
    from tqdm import tqdm

    if batches.dim() != 2:
        raise ValueError(f"batches must be [n_samples, seq_len], got shape {tuple(batches.shape)}")
    blocks_name, blocks = decoder_blocks(model)
    linears, skipped = quantizable_linears(model, recipe)
    block_of: dict[str, int] = {}
    per_block: list[dict[str, nn.Linear]] = [{} for _ in blocks]
    for name, linear in linears.items():
        prefix = blocks_name + "."
        index = name[len(prefix):].split(".", 1)[0] if name.startswith(prefix) else ""
        if index.isdigit() and int(index) < len(blocks):
            block_of[name] = int(index)
            per_block[int(index)][name] = linear
        else:
            skipped.append(SkippedModule(name, "outside the decoder blocks (blockwise calibration covers only them)"))
    device = next(model.parameters()).device
    # true sequential (GPTQ): quantize a block's Linears in stages, each on inputs recomputed through the
    # already-quantized earlier stages. AWQ folds scales into up/v, which must still be float: one stage.
    sequential = recipe.true_sequential and not hasattr(layer_quantizer, "prepare_block")
    # a model loaded with accelerate offload (larger than RAM): one block in RAM at a time, the rest onloaded
    # at the end (the checkpoint needs the float tensors); the quantized Linears are left on meta, not fake-quant
    offloaded = has_offloaded(model)
    if offloaded:
        device = torch.device("cpu")  # offloaded tensors sit on meta; accelerate computes on the CPU here
    calib = forward_dtype(recipe, offloaded, device)

    # GPTAQ: every block also runs in float over the float model's hidden states (a second stream of inputs)
    float_pass = getattr(layer_quantizer, "needs_float_inputs", False)
    # AWQ's first pass under awq_rounding=gptq-sequential: scales searched and folded, nothing rounded
    scales_only = getattr(layer_quantizer, "scales_only", False)
    state = None
    done = 0
    saved_inputs = saved_float = None
    weights: dict[str, QuantizedWeight] = {}
    errors: dict[str, float] = {}
    if state_dir is not None:
        state = Path(state_dir)
        state.mkdir(parents=True, exist_ok=True)
        fingerprint = getattr(layer_quantizer, "fingerprint", None)
        # the scale-tuning knobs act after this driver (a resumed run that changes only them reuses its blocks)
        record = {"version": _STATE_VERSION, "recipe": without_tuning(recipe).to_dict(),
                  "model": model_fingerprint(model),
                  "n_blocks": len(blocks), "batches_sha256": hashlib.sha256(batches.cpu().numpy().tobytes())
                  .hexdigest() + f":{tuple(batches.shape)}",
                  "quantizer": fingerprint() if callable(fingerprint) else type(layer_quantizer).__name__}
        progress_file = state / "progress.json"
        if progress_file.exists():
            old = json.loads(progress_file.read_text())
            old_done = old.pop("blocks_done", 0)
            if old != json.loads(json.dumps(record)):
                raise ValueError(f"{progress_file} belongs to a different run (recipe, model, data or quantizer "
                                 f"differ); use another state_dir or delete it")
            done = old_done
        for i in range(done):  # restore finished blocks: their QuantizedWeights and their fake-quant weights
            saved = torch.load(state / f"block_{i:04d}.pt", weights_only=True)
            for name, d in saved["weights"].items():
                qw = _qw_from_dict(d, device)
                weights[name] = qw
                errors[name] = saved["errors"][name]
                _set_weight(per_block[i][name], qw)
        if 0 < done < len(blocks):
            saved_inputs = torch.load(state / f"inputs_{done:04d}.pt", weights_only=True).to(device)
            if float_pass:
                saved_float = torch.load(state / f"float_inputs_{done:04d}.pt", weights_only=True).to(device)

    timer = PhaseTimer()
    if done < len(blocks):
        with timer("capture block 0 inputs"):
            inputs, block_kwargs = capture_inputs(model, blocks, batches, device)
        # GPTAQ's float stream starts as block 0's inputs (or, resumed, where the float pass left it)
        float_inputs = (list(saved_float.split(1)) if saved_float is not None else inputs) if float_pass else []
        if saved_inputs is not None:
            inputs = list(saved_inputs.split(1))
        if calib is not None:
            inputs = [x.to(calib) for x in inputs]
            float_inputs = [x.to(calib) for x in float_inputs]
            block_kwargs = [_cast_floats(kw, calib) for kw in block_kwargs]
        inputs = batched(inputs, recipe.calib_batch)
        float_inputs = batched(float_inputs, recipe.calib_batch) if float_pass else None
        with tqdm(range(done, len(blocks)), desc=f"blockwise {_pass_name(recipe, layer_quantizer)} int{recipe.bits}",
                  unit="block", disable=not progress, file=sys.stderr, dynamic_ncols=True) as bar:
            for i in bar:
                block, kwargs = blocks[i], block_kwargs[i]
                if offloaded:
                    onload(block)  # this block's weights into RAM, from accelerate's offload folder
                block_weights = {}
                runner, runner_linears = _runner(block, per_block[i], calib)
                if float_pass:  # before any of the block is quantized: its layers' float inputs, its float outputs
                    with timer("block forwards, float pass (GPTAQ)"):
                        recorded, float_inputs = run_float_pass(runner, float_inputs, kwargs, runner_linears)
                    layer_quantizer.float_inputs = {id(lin): recorded[name]
                                                    for linears in (per_block[i], runner_linears)
                                                    for name, lin in linears.items()}
                    del recorded

                def finish(name, qw, linears=per_block[i], runner_linears=runner_linears):
                    errors[name] = relative_error(linears[name].weight, qw)
                    block_weights[name] = qw
                    bar.set_postfix_str(f"{name} rel_err={errors[name]:.4f}", refresh=True)
                    for linear in {id(lin): lin for lin in (linears[name], runner_linears[name])}.values():
                        _set_weight(linear, qw)  # later stages see this layer quantized (true sequential)

                outputs = None
                if sequential and len(inputs) == 1:  # every sample in one batch: the whole block in one forward
                    outputs = quantize_in_one_forward(runner, inputs[0], kwargs, runner_linears, per_block[i],
                                                       layer_quantizer, timer, finish)
                if outputs is not None:
                    inputs = [outputs]
                else:
                    prepare = getattr(layer_quantizer, "prepare_block", None)
                    # AWQ, experimental.awq_next_inputs=float: the statistics forward's outputs (the float
                    # block's) feed block i + 1, as in AutoAWQ, and no outputs pass runs
                    float_next = recipe.experimental.awq_next_inputs == "float"
                    float_outputs = [] if prepare is not None and float_next else None
                    stages = quantization_stages(per_block[i], sequential)
                    for k, stage in enumerate(stages):
                        stage_linears = {name: per_block[i][name] for name in stage}
                        # an earlier stage needs its layers' inputs only: the forward stops once all have fired
                        accumulators, producers = collect_statistics(runner, inputs, kwargs,
                                                           {name: runner_linears[name] for name in stage},
                                                           layer_quantizer, stop_early=k + 1 < len(stages),
                                                           timer=timer, outputs=float_outputs)
                        if prepare is not None:  # AWQ: scale search and fold over the whole block, before rounding
                            if runner is not block:  # fold into the fp32 block's norms, not the bf16 copy's
                                name_of = {id(module): name for name, module in runner.named_modules()}
                                producers = {n: block.get_submodule(name_of[id(m)]) for n, m in producers.items()}
                            with timer("block search (AWQ scales, clip)"):
                                prepare(block, stage_linears, accumulators, producers)
                        solved = {}
                        for name in () if scales_only else stage_linears:
                            if name not in solved:
                                with timer("quantize (GPTQ solve / rounding)"):
                                    solved.update(quantize_sharing(layer_quantizer, name, stage_linears,
                                                                    accumulators))
                            finish(name, solved.pop(name))
                            accumulators[name] = None  # free (a Hessian is in_features² floats)
                        del accumulators
                    if float_outputs is not None:
                        inputs = float_outputs
                    elif i + 1 < len(blocks):
                        if prepare is not None and runner is not block:  # AWQ changed the block's norms too
                            runner, runner_linears = _runner(block, per_block[i], calib)
                        with timer("block forwards, outputs pass"):  # the next block's inputs, from the quantized block
                            inputs = run_block(runner, inputs, kwargs)
                weights.update(block_weights)
                del runner, runner_linears
                if float_pass:
                    layer_quantizer.float_inputs = {}
                if offloaded:
                    release(list(per_block[i].values()))  # RAM stays about one block: the codes are kept
                if state is not None:
                    save_torch_atomic({"weights": {n: _qw_to_dict(q) for n, q in block_weights.items()},
                                  "errors": {n: errors[n] for n in block_weights}}, state / f"block_{i:04d}.pt")
                    if i + 1 < len(blocks):
                        save_torch_atomic(torch.cat(inputs).cpu(), state / f"inputs_{i + 1:04d}.pt")
                        if float_pass:
                            save_torch_atomic(torch.cat(float_inputs).cpu(), state / f"float_inputs_{i + 1:04d}.pt")
                    _atomic_json({**record, "blocks_done": i + 1}, progress_file)
                    (state / f"inputs_{i:04d}.pt").unlink(missing_ok=True)
                    (state / f"float_inputs_{i:04d}.pt").unlink(missing_ok=True)
        del inputs, float_inputs

    if offloaded:
        onload(model)
    ordered = {name: weights[name] for name in linears if name in weights}
    return QuantizedStateDict(weights=ordered, recipe=recipe, skipped=skipped,
                              errors={name: errors[name] for name in ordered}, timings=dict(timer))


def _pass_name(recipe: QuantRecipe, layer_quantizer) -> str:
    """The progress bar's name for a pass: awq_rounding=gptq-sequential runs an AWQ scales pass, then GPTQ's."""
    if getattr(layer_quantizer, "scales_only", False):
        return "awq scales"
    return "gptq" if isinstance(layer_quantizer, GPTQLayerQuantizer) else recipe.method


def without_tuning(recipe: QuantRecipe) -> QuantRecipe:
    """The recipe with the scale-tuning knobs at their defaults: what a calibrating pass's resume record holds."""
    tuning = ("tune_scales_epochs", "tune_scales_lr", "tune_scales_batch", "tune_norms")
    return dataclasses.replace(recipe, **{f.name: f.default for f in dataclasses.fields(QuantRecipe)
                                          if f.name in tuning})
