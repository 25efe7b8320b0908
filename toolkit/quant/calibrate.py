"""Calibration data and the block-by-block driver that data-dependent quantizers (GPTQ, AWQ) run in.

`calibration_batches` cuts deterministic token windows from a dataset's *calibration* split (never the
evaluation split). `quantize_blockwise` walks the decoder blocks one at a time:

1. Capture the inputs of decoder block 0 (one ``[1, seq_len, hidden]`` tensor per sample) and the keyword
   arguments *every* block receives (attention mask, position embeddings, position ids, ...). Blocks may get
   different kwargs (Gemma 3: sliding vs full attention masks, local vs global rotary embeddings), so the
   capture pass hooks every block (forward pre-hook ``with_kwargs=True``), replaces each block's ``forward``
   by the identity for that pass (nothing is computed) and stops the model by raising a private exception
   at the last block. The kwargs are taken from the first sample: all windows have the same length and no
   padding, so they are the same for every sample.
2. For each block ``i``, its quantizable Linear layers in *stages* (`_stages`): with ``recipe.true_sequential``
   (GPTQ's default) q,k,v | o | gate,up | down, else one stage. For each stage the block runs over all inputs
   with forward pre-hooks feeding each layer's input into ``layer_quantizer.accumulator(linear)`` (layers fed
   the very same tensor share one accumulator: one Hessian for q,k,v, not three); a stage that is not the
   last stops the forward once its layers have their inputs. Each layer is quantized with
   ``layer_quantizer.quantize(name, linear, accumulator)`` and its dequantized weight written into the Linear
   at once, so later stages see their inputs through the already-quantized sublayers (true sequential).
   A quantizer with ``prepare_block`` (AWQ) gets the block, its Linears, accumulators and the norm feeding each
   Linear first (scale search and fold); it always runs as one stage, since it folds scales into v/up.
   Then the block runs again to produce the inputs of block ``i + 1`` from the *quantized* block (GPTQ's
   sequential-across-blocks scheme), or, for AWQ with ``awq_next_inputs="float"``, the statistics forward's own
   (float) outputs are those inputs (AutoAWQ's scheme).
3. With every sample in one batch (``recipe.calib_batch == 0``, the default) a true-sequential block needs no
   stages: `_quantize_in_one_forward` hooks the first Linear of each input group, and in ONE forward of the
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
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from toolkit import cpu
from toolkit.fileio import save_torch_atomic
from toolkit.quant.awq import AWQLayerQuantizer, AWQOptions, is_norm
from toolkit.quant.gptq import HessianAccumulator, gptq_quantize
from toolkit.quant.model_quant import (
    QuantizedStateDict,
    QuantRecipe,
    SkippedModule,
    quantizable_linears,
    quantize_model,
    relative_error,
)
from toolkit.quant.offload import has_offloaded, onload, release
from toolkit.quant.primitives import QuantConfig
from toolkit.quant.quantized_weight import QuantizedWeight
from toolkit.quant.rtn import rtn_quantize

__all__ = ["GPTQLayerQuantizer", "RTNLayerQuantizer", "layer_quantizer_for", "calibration_batches", "decoder_blocks", "quantize_blockwise"]

BF16_METHODS = ("gptq", "awq")  # the methods whose calibration forwards may run in bf16 (calib_dtype)
_STATE_VERSION = 2  # 2: the next block's inputs saved as one [n_samples, seq_len, hidden] tensor


# --------------------------------------------------------------------------------------------- calibration data

def _tokenizer_adds_bos(tokenizer) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a")["input_ids"]
    return len(ids) > 0 and ids[0] == bos


def calibration_batches(tokenizer, dataset="pydoc", n_samples: int = 128, seq_len: int = 512, seed: int = 0,
                        add_bos: bool | None = None) -> torch.LongTensor:
    """``[n_samples, seq_len]`` token windows from the calibration split of ``dataset``, deterministically.

    ``dataset`` is a dataset name or path for `toolkit.data.load_text` (its ``"calibration"`` split), several
    joined by ``+`` (``"pydoc+austen"``: a mix, window i taken from source ``i % n`` so every prefix of the
    windows, e.g. AWQ's search samples, holds each source about equally; each source's windows are drawn as if it
    were calibrated alone), or already-loaded texts (a ``datasets.Dataset`` with a ``text`` column, or a list of
    strings). The documents are tokenized without special tokens and concatenated (separated by EOS when the
    tokenizer has one); window starts are drawn with a ``torch.Generator`` seeded with ``seed``. With BOS
    (``add_bos=True``, or ``add_bos=None`` and the tokenizer adds one by default) every window is ``[bos] +
    seq_len - 1 tokens``.
    """
    if n_samples < 1 or seq_len < 2:
        raise ValueError(f"need n_samples >= 1 and seq_len >= 2, got {n_samples}, {seq_len}")
    if isinstance(dataset, str) and "+" in dataset:
        names = [name.strip() for name in dataset.split("+")]
        if any(not name for name in names) or len(set(names)) != len(names):
            raise ValueError(f"a calibration mix names each dataset once, joined by '+' (e.g. pydoc+austen); got "
                             f"{dataset!r}")
        n = len(names)  # window i is window i // n of source i % n, which gives len(range(s, n_samples, n)) of them
        parts = [calibration_batches(tokenizer, name, len(range(s, n_samples, n)), seq_len, seed, add_bos)
                 if s < n_samples else None for s, name in enumerate(names)]
        return torch.stack([parts[i % n][i // n] for i in range(n_samples)])
    if isinstance(dataset, (str, os.PathLike)):
        from toolkit.data import CALIBRATION, load_text

        texts = load_text(dataset, split=CALIBRATION)["text"]
    elif hasattr(dataset, "column_names"):
        texts = dataset["text"]
    else:
        texts = list(dataset)
    if add_bos is None:
        add_bos = _tokenizer_adds_bos(tokenizer)
    if add_bos and getattr(tokenizer, "bos_token_id", None) is None:
        raise ValueError("add_bos=True but the tokenizer has no BOS token")
    eos = getattr(tokenizer, "eos_token_id", None)
    stream: list[int] = []
    for text in texts:
        if not text:
            continue
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            stream.append(eos)
    body = seq_len - 1 if add_bos else seq_len
    if len(stream) < body:
        raise ValueError(f"the calibration text has {len(stream)} tokens, fewer than one window of {body}")
    tokens = torch.tensor(stream, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - body + 1, (n_samples,), generator=generator)
    windows = torch.stack([tokens[s:s + body] for s in starts.tolist()])
    if add_bos:
        windows = torch.cat([torch.full((n_samples, 1), tokenizer.bos_token_id, dtype=torch.long), windows], 1)
    return windows


# --------------------------------------------------------------------------------------------- layer quantizers

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


# --------------------------------------------------------------------------------------------- the driver

class _StopForward(Exception):
    """Raised by the capture hook to stop the model's forward once every block's inputs are known."""


def decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(name, blocks)``: the model's stack of decoder blocks (the largest ``nn.ModuleList`` by parameters)."""
    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[2]:
                best = (name, module, size)
    if best is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of decoder blocks")
    return best[0], best[1]


def _output_hidden(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    raise TypeError(f"decoder block returned {type(out).__name__}; expected a tensor or a tuple")


@torch.no_grad()
def _capture(model, blocks: nn.ModuleList, batches: torch.Tensor, device) -> tuple[list, list[dict]]:
    """Inputs of block 0 (one per sample, on ``device``) and each block's kwargs (from the first sample)."""
    inputs: list[torch.Tensor] = []
    kwargs_per_block: list[dict | None] = [None] * len(blocks)
    handles = []
    current = {"sample": 0}

    def make_hook(i):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            if i == 0:
                inputs.append(hidden.detach())
            if current["sample"] == 0:
                kwargs_per_block[i] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            if i == len(blocks) - 1 or current["sample"] > 0:  # later samples only need block 0's input
                raise _StopForward
        return hook

    def identity(*args, **kwargs):
        return args[0] if args else kwargs["hidden_states"]

    # an accelerate-dispatched block already has an instance forward (its hook's wrapper): put it back after
    saved_forwards = [block.__dict__.get("forward") for block in blocks]
    try:
        for i, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(make_hook(i), with_kwargs=True))
            block.forward = identity  # instance attribute: nn.Module.__call__ runs it instead of the class's
        for j in range(batches.shape[0]):
            current["sample"] = j
            try:
                model(input_ids=batches[j:j + 1].to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        for handle in handles:
            handle.remove()
        for block, forward in zip(blocks, saved_forwards):
            block.__dict__.pop("forward", None)
            if forward is not None:
                block.forward = forward
    if len(inputs) != batches.shape[0] or any(k is None for k in kwargs_per_block):
        raise RuntimeError("could not capture the decoder blocks' inputs (does the model call its blocks?)")
    return inputs, kwargs_per_block


# The order a Llama/Qwen/Gemma decoder block runs its Linears in; each stage's inputs depend only on earlier ones.
_STAGE_OF = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3}


def _stages(linears: dict[str, nn.Linear], sequential: bool) -> list[list[str]]:
    """The block's Linear names in quantization stages: one stage, or (``sequential``) q,k,v | o | gate,up |
    down. A block with a Linear of another name gets one stage: its order is unknown, so none is assumed."""
    names = list(linears)
    suffixes = [name.rsplit(".", 1)[-1] for name in names]
    if not sequential or not names or any(s not in _STAGE_OF for s in suffixes):
        return [names] if names else []
    stages: dict[int, list[str]] = {}
    for name, suffix in zip(names, suffixes):
        stages.setdefault(_STAGE_OF[suffix], []).append(name)
    return [stages[k] for k in sorted(stages)]


@torch.no_grad()
def _collect(block, inputs, kwargs, linears: dict[str, nn.Linear], layer_quantizer, stop_early: bool,
             timer: _Timer | None = None, outputs: list | None = None):
    """Run ``block`` over ``inputs`` feeding each Linear's input to its accumulator; ``(accumulators, producers)``.

    Linears that receive the very same tensor (q,k,v; gate,up) share ONE accumulator: one Hessian, not three.
    With ``stop_early`` the block's forward is cut (a private exception) once every Linear has its input, so
    an early stage costs a partial forward. ``producers`` (for quantizers with ``needs_producers``) maps a
    Linear's name to the block's norm module whose output tensor IS that Linear's input (from the first sample).
    ``outputs`` (a list, only without ``stop_early``) receives the block's output for each input batch. Each
    batch runs in slices of `_FORWARD_SAMPLES` samples.
    """
    timer = timer if timer is not None else _Timer()
    accumulators: dict[str, object] = {}
    fresh = {name: layer_quantizer.accumulator(lin) for name, lin in linears.items()}
    if all(acc is None for acc in fresh.values()):
        return fresh, {}
    want_producers = getattr(layer_quantizer, "needs_producers", False)
    norm_outputs: dict[str, torch.Tensor] = {}
    producers: dict[str, nn.Module] = {}
    seen: dict[str, torch.Tensor] = {}  # this sample: name -> the input tensor it got
    fed: set[int] = set()  # this sample: ids of the accumulators that got its input
    distinct: list[int] = []  # [number of distinct accumulators], known after the first sample
    handles = []

    def make_hook(name):
        def hook(module, args):
            x = args[0]
            if name not in accumulators:  # first sample: share with a layer that got this same tensor
                same = next((other for other, t in seen.items() if t is x), None)
                accumulators[name] = accumulators[same] if same is not None else fresh[name]
                if want_producers:
                    producer = next((n for n, t in norm_outputs.items() if t is x), None)
                    if producer is not None:
                        producers[name] = block.get_submodule(producer)
            if not any(t is x and accumulators[other] is accumulators[name] for other, t in seen.items()):
                with timer("statistics (Hessians / input copies)"):
                    accumulators[name].add(x.detach())
            seen[name] = x
            fed.add(id(accumulators[name]))
            # the first sample runs until every Linear has fired (that is how sharing is found); later ones
            # stop as soon as each distinct accumulator has this sample (q's input is k's and v's too)
            if stop_early and (len(seen) == len(linears) or (distinct and len(fed) == distinct[0])):
                raise _StopForward
        return hook

    def norm_hook(name):
        def hook(module, args, out):
            norm_outputs[name] = out
        return hook

    try:
        for name, lin in linears.items():
            handles.append(lin.register_forward_pre_hook(make_hook(name)))
        if want_producers:
            for name, module in block.named_modules():
                if is_norm(name, module):
                    handles.append(module.register_forward_hook(norm_hook(name)))
        for batch in inputs:
            parts = []
            for x in batch.split(_FORWARD_SAMPLES):
                if seen and not distinct and len(accumulators) == len(linears):
                    distinct.append(len({id(acc) for acc in accumulators.values()}))
                seen.clear()
                fed.clear()
                norm_outputs.clear()
                try:
                    with timer("block forwards, statistics pass"):
                        out = block(x, **kwargs)
                    if outputs is not None:
                        parts.append(_output_hidden(out).detach())
                except _StopForward:
                    pass
                if want_producers:  # only the first sample decides producers: stop recording norm outputs
                    for handle in handles[len(linears):]:
                        handle.remove()
                    del handles[len(linears):]
                    want_producers = False
            if outputs is not None:
                outputs.append(torch.cat(parts))
    finally:
        for handle in handles:
            handle.remove()
    missing = [name for name in linears if name not in accumulators]
    if missing:
        raise RuntimeError(f"the block never called {', '.join(missing)} during calibration")
    return accumulators, producers


class _Timer(defaultdict):
    """Seconds by phase: ``with timer("solve"): ...``; nested phases are subtracted from their parent."""

    def __init__(self):
        super().__init__(float)
        self._stack: list[list] = []

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        self._stack.append([phase, 0.0])
        try:
            yield
        finally:
            _, inner = self._stack.pop()
            spent = time.perf_counter() - start
            self[phase] += spent - inner
            if self._stack:
                self._stack[-1][1] += spent


# Samples per block forward CALL in the staged path (a batch of inputs is run in slices of this many): a
# 65,536-token batch's MLP temporaries (65,536 x 1536 per tensor on SmolLM2) leave the caches and fault in fresh
# pages; slices of 8 x 512 tokens ran a SmolLM2 block ~20% faster (2.1 vs 2.6 s for 128 samples). The one-forward
# GPTQ scheme cannot slice: each of its hooks needs every sample's input at once. (Slices in threads meeting at
# each hook were tried: 148 s instead of 126 s and twice the peak RSS, per-thread malloc arenas and OpenMP teams.)
_FORWARD_SAMPLES = 8


def _run_block(block, inputs, kwargs) -> list[torch.Tensor]:
    return [torch.cat([_output_hidden(block(x, **kwargs)).detach() for x in batch.split(_FORWARD_SAMPLES)])
            for batch in inputs]


def _float_pass(block, inputs, kwargs, linears: dict[str, nn.Linear]):
    """GPTAQ's float pass: ``block`` (not yet quantized) over the float model's hidden states ``inputs``.

    Returns ``(recorded, outputs)``: each Linear's inputs as ``[n_tokens, in]`` rows in sample order (Linears fed
    the same tensor, q,k,v or gate,up, share one), and the block's outputs, the float model's next hidden states.
    """
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in linears}
    alias: dict[str, str] = {}
    seen: dict[str, torch.Tensor] = {}

    def hook(module, args, name):
        x = args[0]
        if name not in alias:
            same = next((other for other, t in seen.items() if t is x), None)
            if same is not None:
                alias[name] = same
            else:
                parts[name].append(x.detach().reshape(-1, x.shape[-1]))
        seen[name] = x

    handles = [lin.register_forward_pre_hook(lambda module, args, name=name: hook(module, args, name))
               for name, lin in linears.items()]
    outputs = []
    try:
        for batch in inputs:
            chunks = []
            for x in batch.split(_FORWARD_SAMPLES):
                seen.clear()
                chunks.append(_output_hidden(block(x, **kwargs)).detach())
            outputs.append(torch.cat(chunks))
    finally:
        for handle in handles:
            handle.remove()
    recorded = {name: torch.cat(rows) for name, rows in parts.items() if name not in alias}
    recorded.update({name: recorded[source] for name, source in alias.items()})
    return recorded, outputs


def _batched(inputs: list[torch.Tensor], size: int) -> list[torch.Tensor]:
    """Per-sample ``[1, seq, hidden]`` inputs as batches of ``size`` samples (0: one batch of all)."""
    size = size or len(inputs)
    return [torch.cat(inputs[j:j + size]) for j in range(0, len(inputs), size)]


@torch.no_grad()
def _input_groups(block, x, kwargs, linears: dict[str, nn.Linear]) -> list[list[str]] | None:
    """The block's Linears grouped by the input tensor they receive (q,k,v; gate,up), groups in call order, from
    one forward of ``x``; None if a Linear is called more than once or never (no single-forward scheme then)."""
    calls: list[tuple[str, torch.Tensor]] = []
    handles = [lin.register_forward_pre_hook(lambda module, args, name=name: calls.append((name, args[0])))
               for name, lin in linears.items()]
    try:
        block(x, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    names = [name for name, _ in calls]
    if sorted(names) != sorted(linears):
        return None
    groups: list[list[str]] = []
    tensors: list[torch.Tensor] = []
    for name, t in calls:
        same = next((k for k, other in enumerate(tensors) if other is t), None)
        if same is None:
            groups.append([name])
            tensors.append(t)
        else:
            groups[same].append(name)
    return groups


@torch.no_grad()
def _quantize_in_one_forward(runner, x, kwargs, runner_linears: dict[str, nn.Linear],
                             block_linears: dict[str, nn.Linear], layer_quantizer, timer: _Timer, finish):
    """True-sequential quantization of one block in ONE forward over the whole batch ``x``; returns the block's
    output (the next block's input, through the quantized block), or None when `_input_groups` finds no
    single-forward order (the caller then runs the stages one by one).

    A forward pre-hook on the first Linear of each input group (q of q,k,v; o; gate of gate,up; down) receives
    that group's input for every sample at once: it feeds the accumulator, quantizes the group and writes the
    quantized weights (``finish``) before the Linear runs, so everything downstream in the same forward already
    sees them. The staged scheme computes the same inputs with a partial forward per stage and then a full
    outputs pass (about 3.4 forwards of a Llama block instead of one).
    """
    groups = _input_groups(runner, x[:1], kwargs, runner_linears)
    if groups is None:
        return None
    handles = []

    def make_hook(group):
        def hook(module, args):
            accumulator = layer_quantizer.accumulator(block_linears[group[0]])
            if accumulator is not None:  # RTN (an offloaded model walked block by block) needs no data
                with timer("statistics (Hessians / input copies)"):
                    accumulator.add(args[0].detach())
            members = {name: block_linears[name] for name in group}
            solved: dict = {}
            for name in group:
                if name not in solved:  # all at once where the quantizer solves layers together
                    with timer("quantize (GPTQ solve / rounding)"):
                        solved.update(_quantize_sharing(layer_quantizer, name, members,
                                                        dict.fromkeys(group, accumulator)))
                finish(name, solved.pop(name))
        return hook

    try:
        for group in groups:
            handles.append(runner_linears[group[0]].register_forward_pre_hook(make_hook(group)))
        with timer("block forwards, one pass (statistics and outputs)"):
            return _output_hidden(runner(x, **kwargs)).detach()
    finally:
        for handle in handles:
            handle.remove()


def _quantize_sharing(layer_quantizer, name: str, linears: dict[str, nn.Linear], accumulators: dict) -> dict:
    """``{name: QuantizedWeight}`` for ``name`` and, where the quantizer can solve layers together
    (``quantize_together``), every layer of ``linears`` whose accumulator is ``name``'s (q,k,v; gate,up)."""
    together = getattr(layer_quantizer, "quantize_together", None)
    shared = [n for n in linears if accumulators[n] is accumulators[name]]
    if together is None or len(shared) == 1:
        return {name: layer_quantizer.quantize(name, linears[name], accumulators[name])}
    return dict(zip(shared, together([linears[n] for n in shared], accumulators[name])))


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


def _forward_dtype(recipe: QuantRecipe, offloaded: bool, device) -> torch.dtype | None:
    """The dtype of a run's calibration forwards, or None for the model's own. GPTQ and AWQ may run them on a bf16
    copy of each block (`calibration_dtype`; AWQ folds and clips the fp32 block itself, then takes a fresh copy
    for an outputs pass); an offloaded block is accelerate's to move, and RTN needs no data: those stay as they
    are. Scale tuning's forwards (any method) run in it too."""
    if (recipe.method not in BF16_METHODS and not recipe.tune_scales_epochs) or offloaded:
        return None
    return calibration_dtype(recipe, device)


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
    import copy

    copy_ = copy.deepcopy(block).to(dtype)
    by_module = {id(module): name for name, module in block.named_modules()}
    return copy_, {name: copy_.get_submodule(by_module[id(lin)]) for name, lin in block_linears.items()}


def _model_fingerprint(model) -> dict:
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
    calib = _forward_dtype(recipe, offloaded, device)

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
        record = {"version": _STATE_VERSION, "recipe": _without_tuning(recipe).to_dict(),
                  "model": _model_fingerprint(model),
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

    timer = _Timer()
    if done < len(blocks):
        with timer("capture block 0 inputs"):
            inputs, block_kwargs = _capture(model, blocks, batches, device)
        # GPTAQ's float stream starts as block 0's inputs (or, resumed, where the float pass left it)
        float_inputs = (list(saved_float.split(1)) if saved_float is not None else inputs) if float_pass else []
        if saved_inputs is not None:
            inputs = list(saved_inputs.split(1))
        if calib is not None:
            inputs = [x.to(calib) for x in inputs]
            float_inputs = [x.to(calib) for x in float_inputs]
            block_kwargs = [_cast_floats(kw, calib) for kw in block_kwargs]
        inputs = _batched(inputs, recipe.calib_batch)
        float_inputs = _batched(float_inputs, recipe.calib_batch) if float_pass else None
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
                        recorded, float_inputs = _float_pass(runner, float_inputs, kwargs, runner_linears)
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
                    outputs = _quantize_in_one_forward(runner, inputs[0], kwargs, runner_linears, per_block[i],
                                                       layer_quantizer, timer, finish)
                if outputs is not None:
                    inputs = [outputs]
                else:
                    prepare = getattr(layer_quantizer, "prepare_block", None)
                    # AWQ, awq_next_inputs=float: the statistics forward's outputs (the float block's) feed block
                    # i + 1, as in AutoAWQ, and no outputs pass runs
                    float_outputs = [] if prepare is not None and recipe.awq_next_inputs == "float" else None
                    stages = _stages(per_block[i], sequential)
                    for k, stage in enumerate(stages):
                        stage_linears = {name: per_block[i][name] for name in stage}
                        # an earlier stage needs its layers' inputs only: the forward stops once all have fired
                        accumulators, producers = _collect(runner, inputs, kwargs,
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
                                    solved.update(_quantize_sharing(layer_quantizer, name, stage_linears,
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
                            inputs = _run_block(runner, inputs, kwargs)
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
                                  block_size=r.block_size, act_order=r.act_order, static_groups=r.static_groups,
                                  mse=r.mse, bias=linear.bias, delta_xxt=accumulator.delta_xxt,
                                  asym_alpha=r.gptaq_alpha, asym_max_step=r.gptaq_max_step)
        return qw

    def quantize_together(self, linears: list[nn.Linear], accumulator) -> list[QuantizedWeight]:
        """Layers fed the same input (one Hessian: q,k,v; gate,up) solved as ONE stacked weight: GPTQ treats each
        output row on its own given H, so the codes are the separate solves' (tested), in one column loop."""
        r = self.recipe
        stacked = torch.cat([lin.weight for lin in linears])
        qw, _loss = gptq_quantize(stacked, accumulator.hessian, r.config, damp_percent=r.damp_percent,
                                  block_size=r.block_size, act_order=r.act_order, static_groups=r.static_groups,
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
                "block_size": r.block_size, "act_order": r.act_order, "static_groups": r.static_groups, "mse": r.mse,
                "gptaq_alpha": r.gptaq_alpha, "gptaq_max_step": r.gptaq_max_step}


def make_quantized_state_dict(model: nn.Module, tokenizer, recipe: QuantRecipe, progress: bool = True,
                              state_dir: str | os.PathLike | None = None) -> QuantizedStateDict:
    """The one entry point for `specquant quantize`: RTN needs no data; GPTQ and AWQ calibrate block by block;
    with ``recipe.tune_scales_epochs`` the scales the method chose are then tuned end to end (`_tune_scales`).

    The recipe the result carries (and the checkpoint's manifest records) names the calibration dtype the run
    used: ``calib_dtype=auto`` becomes bf16 or fp32; fp32 for the methods and offloaded models that never use bf16.
    """
    device = next(model.parameters()).device
    offloaded = has_offloaded(model)
    bf16 = _forward_dtype(recipe, offloaded, device) is not None
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


def _without_tuning(recipe: QuantRecipe) -> QuantRecipe:
    """The recipe with the scale-tuning knobs at their defaults: what a calibrating pass's resume record holds."""
    tuning = ("tune_scales_epochs", "tune_scales_lr", "tune_scales_batch", "tune_norms")
    return dataclasses.replace(recipe, **{f.name: f.default for f in dataclasses.fields(QuantRecipe)
                                          if f.name in tuning})


def _tune_scales(model: nn.Module, teacher: nn.Module, qsd: QuantizedStateDict, batches: torch.Tensor,
                 recipe: QuantRecipe, device, progress: bool, state_dir) -> QuantizedStateDict:
    """The method's codes and zeros kept, its scales trained to lower KL(teacher || model) on ``batches``."""
    from toolkit.quant.scale_tuning import ScaleTuneOptions, tune_scales

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
    record = {"recipe": first.to_dict(), "model": _model_fingerprint(model), "options": dataclasses.asdict(options),
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
    gptq_only = ("damp_percent", "act_order", "static_groups", "block_size", "mse", "gptaq_alpha", "gptaq_max_step")
    defaults = {f.name: f.default for f in dataclasses.fields(QuantRecipe) if f.name in gptq_only}
    return _without_tuning(dataclasses.replace(recipe, awq_next_inputs="float", **defaults))


def fold_awq_scales(model: nn.Module, recipe: QuantRecipe, batches: torch.Tensor, device="cpu",
                    progress: bool = True) -> QuantizedStateDict:
    """AWQ with nothing rounded: every block's scales searched and folded, its clips applied, in place; the model
    stays float (an equivalent model but for the clips). Returns the pass's result (no weights; its timings)."""
    return quantize_blockwise(model, _fold_recipe(recipe), batches,
                              AWQLayerQuantizer(recipe.config, awq_options(recipe, device), scales_only=True),
                              progress=progress)


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
    return AWQOptions(grid=recipe.awq_grid, coarse_step=recipe.awq_coarse_step, duo_scaling=recipe.awq_duo_scaling,
                      clip=recipe.awq_clip, clip_grid=recipe.awq_clip_grid, max_shrink=recipe.awq_max_shrink,
                      clip_tokens=recipe.awq_clip_tokens, clip_asym=recipe.awq_clip_asym,
                      search_samples=recipe.awq_search_samples, mlp_dtype=mlp_dtype, gqa_v_o=recipe.awq_gqa_v_o)
