"""Forward passes over decoder blocks, the pieces of the blockwise calibration driver (`toolkit.quant.blockwise`):
finding the stack of blocks, capturing block 0's inputs and every block's keyword arguments, running a block over
calibration inputs while its Linears' inputs feed the quantizer's accumulators (staged, or the whole block in one
forward), GPTAQ's float pass, and the per-phase timer the driver reports."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch import nn

from toolkit.quant.awq import is_norm

__all__ = ["PhaseTimer", "batched", "capture_inputs", "collect_statistics", "decoder_blocks", "quantization_stages",
           "quantize_in_one_forward", "quantize_sharing", "run_block", "run_float_pass"]


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
def capture_inputs(model, blocks: nn.ModuleList, batches: torch.Tensor, device) -> tuple[list, list[dict]]:
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


def quantization_stages(linears: dict[str, nn.Linear], sequential: bool) -> list[list[str]]:
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
def collect_statistics(block, inputs, kwargs, linears: dict[str, nn.Linear], layer_quantizer, stop_early: bool,
             timer: PhaseTimer | None = None, outputs: list | None = None):
    """Run ``block`` over ``inputs`` feeding each Linear's input to its accumulator; ``(accumulators, producers)``.

    Linears that receive the very same tensor (q,k,v; gate,up) share ONE accumulator: one Hessian, not three.
    With ``stop_early`` the block's forward is cut (a private exception) once every Linear has its input, so
    an early stage costs a partial forward. ``producers`` (for quantizers with ``needs_producers``) maps a
    Linear's name to the block's norm module whose output tensor IS that Linear's input (from the first sample).
    ``outputs`` (a list, only without ``stop_early``) receives the block's output for each input batch. Each
    batch runs in slices of `_FORWARD_SAMPLES` samples.
    """
    timer = timer if timer is not None else PhaseTimer()
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


class PhaseTimer(defaultdict):
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


def run_block(block, inputs, kwargs) -> list[torch.Tensor]:
    return [torch.cat([_output_hidden(block(x, **kwargs)).detach() for x in batch.split(_FORWARD_SAMPLES)])
            for batch in inputs]


def run_float_pass(block, inputs, kwargs, linears: dict[str, nn.Linear]):
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


def batched(inputs: list[torch.Tensor], size: int) -> list[torch.Tensor]:
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
def quantize_in_one_forward(runner, x, kwargs, runner_linears: dict[str, nn.Linear],
                             block_linears: dict[str, nn.Linear], layer_quantizer, timer: PhaseTimer, finish):
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
                        solved.update(quantize_sharing(layer_quantizer, name, members,
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


def quantize_sharing(layer_quantizer, name: str, linears: dict[str, nn.Linear], accumulators: dict) -> dict:
    """``{name: QuantizedWeight}`` for ``name`` and, where the quantizer can solve layers together
    (``quantize_together``), every layer of ``linears`` whose accumulator is ``name``'s (q,k,v; gate,up)."""
    together = getattr(layer_quantizer, "quantize_together", None)
    shared = [n for n in linears if accumulators[n] is accumulators[name]]
    if together is None or len(shared) == 1:
        return {name: layer_quantizer.quantize(name, linears[name], accumulators[name])}
    return dict(zip(shared, together([linears[n] for n in shared], accumulators[name])))

