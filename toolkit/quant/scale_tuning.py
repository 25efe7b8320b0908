"""End-to-end tuning of a quantized model's group scales, its integer codes and zeros fixed.

After any method has chosen the codes (RTN, GPTQ, AWQ), each group's scale is still a free float: the weight a
layer runs is ``(codes - zero) * scale``, linear in the scale, so the scales can be trained by plain gradient
descent with no straight-through estimator. The loss is the whole model's: KL(float model || quantized model)
per token over the calibration windows, so a scale moves to fix what the model's output loses, wherever in
the stack the error came from (block-wise methods each fit one layer or block to its own target). This is
EfficientQAT's end-to-end step (E2E-QP, Chen et al. 2024), which trains step sizes with the codes frozen; here
only the scales train (the zeros stay integers, so the GPTQ and AWQ export formats still hold the result).

A scale is trained as ``scale0 * exp(theta)``, theta starting at 0: Adam's step is then a relative change of the
scale (the scales of one model span orders of magnitude), and a scale cannot change sign. The learning rate
follows a cosine from ``lr`` to 0 over all steps.

With ``norms`` the RMSNorm gains train beside the scales, the same way (``gain0 * exp(theta)`` per channel; for
Gemma's ``(1 + w)`` norms the gain is ``1 + w``): Norm Tweaking's idea (Li et al., 2023), the norms being float
in every checkpoint format. A gain scales the channels it feeds into every Linear that reads the norm, which the
per-group scales cannot do across a Linear's output rows, and it costs a few thousand numbers a block.

With ``state_path`` the run saves theta, Adam's state and the step count every `SAVE_EVERY` steps (atomically),
with a record of the run (options, the starting scales' and the data's hashes); a killed run restarts from the
last save and, the window order being a function of the epoch, takes the same steps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from toolkit.fileio import save_torch_atomic
from toolkit.quant.awq import is_norm, norm_kind
from toolkit.quant.quantized_weight import QuantizedWeight

SAVE_EVERY = 16  # steps between saves of a resumable run's state
_REPORT_WINDOWS = 8  # calibration windows the before/after KL is measured on


@dataclasses.dataclass(frozen=True)
class ScaleTuneOptions:
    epochs: int = 1  # passes over the calibration windows
    lr: float = 5e-4  # Adam's learning rate on log(scale)
    batch: int = 1  # windows per step
    dtype: torch.dtype | None = None  # autocast dtype of the forwards (bf16 where the CPU multiplies it natively)
    norms: bool = False  # also train the RMSNorm gains (float in every format), relative steps as the scales


class _GroupScaledWeight(nn.Module):
    """A parametrization: the Linear's weight is ``(codes - zero) * scale0 * exp(theta)`` per group."""

    def __init__(self, qw: QuantizedWeight):
        super().__init__()
        groups = qw.group_index()
        # codes - zero are integers in [-(2^bits - 1), 2^bits - 1]: exact in bf16 for up to 8 bits, at half the bytes
        self.register_buffer("offsets", (qw.codes.float() - qw.zero[:, groups].float()).to(torch.bfloat16))
        self.register_buffer("scale0", qw.scale.float().clone())
        self.theta = nn.Parameter(torch.zeros_like(self.scale0))
        # Each column's group scale, without a per-column gather (``scale[:, groups]``), whose backward is a
        # scatter-add (index and index_put: 15% of a Gemma tuning step). Groups of consecutive columns, all of
        # one width: the scale broadcast over a [out, groups, width] view, its backward a sum per group. Others
        # (act-order's permutation, a ragged last group): ``scale @ one_hot``, [out, groups] x [groups, in], exact
        # (one nonzero term per sum), its backward a matmul (4-5x faster than the gather's on Gemma's shapes).
        out, cols = self.offsets.shape
        width = cols // self.scale0.shape[1]
        self.width = width if width * self.scale0.shape[1] == cols and torch.equal(
            groups, torch.arange(cols) // width) else None
        if self.width is None:
            self.register_buffer("one_hot", F.one_hot(groups, self.scale0.shape[1]).t().float().contiguous())

    def scale(self) -> torch.Tensor:
        return self.scale0 * torch.exp(self.theta)

    def forward(self, _original: torch.Tensor) -> torch.Tensor:
        if self.width is not None:
            out, cols = self.offsets.shape
            return (self.offsets.float().view(out, -1, self.width) * self.scale()[:, :, None]).view(out, cols)
        # (float32 even under autocast, which would run the matmul in bf16 and round the scales)
        with torch.autocast(self.offsets.device.type, enabled=False):
            return self.offsets.float() * (self.scale() @ self.one_hot)


class _RelativeGain(nn.Module):
    """A parametrization of a norm's weight: its gain (``w``, or ``1 + w`` for ``offset`` norms) times ``exp(theta)``,
    written ``w + gain * expm1(theta)`` so that theta = 0 is the norm bit for bit."""

    def __init__(self, weight: torch.Tensor, offset: bool):
        super().__init__()
        self.register_buffer("gain0", (weight.detach().float() + (1.0 if offset else 0.0)).clone())
        self.theta = nn.Parameter(torch.zeros_like(self.gain0))

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        return original + (self.gain0 * torch.expm1(self.theta)).to(original.dtype)


def _norms(model: nn.Module) -> dict[str, nn.Module]:
    """The model's RMSNorms with a 1-d gain (the decoder's, the final one, Gemma's q/k norms), by module name."""

    return {name: module for name, module in model.named_modules()
            if is_norm(name, module)
            and isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() == 1}


_KL_CHUNK_ELEMENTS = 1 << 19  # logits per chunk of positions (float32: 2 MB, so a chunk's passes stay in cache)


def _chunks(student: torch.Tensor, teacher: torch.Tensor):
    """``(rows, log_softmax(student[rows]), log_softmax(teacher[rows]))`` in float32 over [positions, vocab]
    logits, `_KL_CHUNK_ELEMENTS` logits' worth of positions at a time."""
    step = max(1, _KL_CHUNK_ELEMENTS // student.shape[-1])
    for i in range(0, student.shape[0], step):
        rows = slice(i, i + step)
        # (dtype=: the kernel reads bf16 logits and computes in float32, no float32 copy of the chunk first)
        yield (rows, torch.log_softmax(student[rows], -1, dtype=torch.float32),
               torch.log_softmax(teacher[rows], -1, dtype=torch.float32))


class _ChunkedKL(torch.autograd.Function):
    """KL(teacher || student) per row of [positions, vocab] logits, a chunk of rows at a time.

    Autograd's version (``F.kl_div`` of two ``log_softmax``) runs each op over the whole window and keeps its
    float32 intermediates for the backward: with Gemma's 262,144-token vocabulary 537 MB each, every pass a trip
    to memory, a third of a tuning step's time. Here forward and backward each go over the logits a chunk of
    positions at a time, small enough that a chunk's several passes stay in cache (the backward recomputes the
    log-softmaxes), and keep only the logits: forward and backward 3x faster on Gemma's windows. The gradient is
    the one autograd forms: d/dz of ``sum p_t (log p_t - log_softmax(z))`` is ``softmax(z) * sum(p_t) - p_t``."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        out = torch.empty(student.shape[0], dtype=torch.float32, device=student.device)
        for rows, s, t in _chunks(student, teacher):
            out[rows] = F.kl_div(s, t, log_target=True, reduction="none").sum(-1)
        ctx.save_for_backward(student, teacher)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        student, teacher = ctx.saved_tensors
        grad_student = torch.empty_like(student)
        for rows, s, t in _chunks(student, teacher):
            p_t = t.exp_()
            grad_student[rows] = s.exp_().mul_(p_t.sum(-1, keepdim=True)).sub_(p_t).mul_(grad[rows, None])
        return grad_student, None


def _kl_per_token(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per position [batch, positions - 1], every position after the first (the first
    predicts from BOS alone); the teacher's logits get no gradient."""
    batch, positions = student_logits.shape[:2]
    rows = [_ChunkedKL.apply(student_logits[b, 1:], teacher_logits[b, 1:].detach()) for b in range(batch)]
    return torch.stack(rows).reshape(batch, positions - 1)


def _window_order(n: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).tolist()


def _record(weights: dict[str, QuantizedWeight], batches: torch.Tensor, options: ScaleTuneOptions) -> str:
    digest = hashlib.sha256()
    for name, qw in weights.items():
        digest.update(name.encode())
        digest.update(qw.scale.float().contiguous().numpy().tobytes())
    return json.dumps({"options": {**dataclasses.asdict(options), "dtype": str(options.dtype)},
                       "scales_sha256": digest.hexdigest(),
                       "batches_sha256": hashlib.sha256(batches.cpu().numpy().tobytes()).hexdigest()},
                      sort_keys=True)


@torch.no_grad()
def _mean_kl(student: nn.Module, teacher: nn.Module, batches: torch.Tensor, dtype) -> float:
    total = 0.0
    for window in batches[:_REPORT_WINDOWS]:
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            total += float(_kl_per_token(student(window[None]).logits, teacher(window[None]).logits).mean())
    return total / min(len(batches), _REPORT_WINDOWS)


def tune_scales(student: nn.Module, teacher: nn.Module, weights: dict[str, QuantizedWeight], batches: torch.Tensor,
                options: ScaleTuneOptions, progress: bool = True,
                state_path: str | os.PathLike | None = None) -> tuple[dict[str, QuantizedWeight], dict]:
    """Train the group scales of ``weights`` (module name -> QuantizedWeight of a Linear in ``student``) so that
    ``student`` matches ``teacher`` (the float model) on ``batches`` [n, seq_len].

    Returns the QuantizedWeights with the tuned scales (codes, zeros, g_idx, bias unchanged) and a report:
    ``kl_before``, ``kl_after`` (mean KL per token on the first calibration windows), ``steps``, ``seconds``.
    ``student``'s Linears are left holding the tuned weights, dequantized (a fake-quant model, as the calibrating
    driver leaves it). Both models must be on the CPU and in RAM (not offloaded).
    """
    from tqdm import tqdm

    if options.epochs < 1 or options.batch < 1 or not options.lr > 0:
        raise ValueError(f"scale tuning needs epochs >= 1, batch >= 1 and lr > 0; got {options}")
    start = time.perf_counter()
    for p in (*student.parameters(), *teacher.parameters()):
        p.requires_grad_(False)
    scaled: dict[str, _GroupScaledWeight] = {}
    for name, qw in weights.items():
        scaled[name] = _GroupScaledWeight(qw)
        parametrize.register_parametrization(student.get_submodule(name), "weight", scaled[name], unsafe=True)
    gains: dict[str, _RelativeGain] = {}
    if options.norms:

        for name, norm in _norms(student).items():
            gains[name] = _RelativeGain(norm.weight, norm_kind(norm, norm.weight.numel()) == "offset")
            parametrize.register_parametrization(norm, "weight", gains[name], unsafe=True)
    thetas = [m.theta for m in (*scaled.values(), *gains.values())]
    optimizer = torch.optim.Adam(thetas, lr=options.lr)
    n = len(batches)
    steps_per_epoch = math.ceil(n / options.batch)
    total = options.epochs * steps_per_epoch
    record = _record(weights, batches, options)
    step = 0
    state = Path(state_path) if state_path is not None else None
    try:
        if state is not None and state.exists():
            saved = torch.load(state, weights_only=True)
            if saved["record"] != record:
                raise ValueError(f"{state} belongs to a different scale-tuning run (options, codes or data differ); "
                                 f"delete it or use another state folder")
            for theta, value in zip(thetas, saved["thetas"]):
                theta.data.copy_(value)
            optimizer.load_state_dict(saved["optimizer"])
            step = saved["step"]
        kl_before = _mean_kl(student, teacher, batches, options.dtype) if step == 0 else None
        with tqdm(total=total, initial=step, desc="scale tuning (KL to the float model)", unit="step",
                  disable=not progress, file=sys.stderr, dynamic_ncols=True) as bar:
            while step < total:
                epoch, k = divmod(step, steps_per_epoch)
                ids = batches[_window_order(n, epoch)[k * options.batch:(k + 1) * options.batch]]
                for group in optimizer.param_groups:  # cosine from lr to 0, a function of the step (resumable)
                    group["lr"] = options.lr * 0.5 * (1 + math.cos(math.pi * step / total))
                with torch.autocast("cpu", dtype=options.dtype or torch.float32, enabled=options.dtype is not None):
                    with torch.no_grad():
                        teacher_logits = teacher(ids).logits
                    loss = _kl_per_token(student(ids).logits, teacher_logits).mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                bar.update(1)
                bar.set_postfix_str(f"kl={float(loss.detach()):.4f}", refresh=False)
                if state is not None and (step % SAVE_EVERY == 0 or step == total):
                    save_torch_atomic({"record": record, "step": step, "thetas": [t.detach() for t in thetas],
                                  "optimizer": optimizer.state_dict()}, state)
        kl_after = _mean_kl(student, teacher, batches, options.dtype)
        tuned = {name: dataclasses.replace(qw, scale=scaled[name].scale().detach().float().clone())
                 for name, qw in weights.items()}
    finally:
        # the tuned (or, interrupted, the current) weights stay in the Linears and norms as plain tensors
        for name in (*scaled, *gains):
            parametrize.remove_parametrizations(student.get_submodule(name), "weight", leave_parametrized=True)
            student.get_submodule(name).weight.requires_grad_(False)
    report = {"kl_before": kl_before, "kl_after": kl_after, "steps": total,
              "seconds": time.perf_counter() - start}
    return tuned, report
