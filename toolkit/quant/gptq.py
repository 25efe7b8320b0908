"""GPTQ (Frantar et al., 2022): quantize a weight column by column, pushing each column's rounding error onto the
columns not yet quantized through the inverse Hessian of the layer's inputs, so the layer OUTPUT moves least.

The grid is the one of `toolkit.quant.primitives` (same ``choose_qparams`` / quantizer formula as RTN); only the
choice of codes differs. Every knob of the paper / reference implementations (IST-DASLab/gptq ``fasterquant``,
AutoGPTQ ``GPTQ.fasterquant``) is one named option of `gptq_quantize`.

Two deliberate differences from the reference, both documented where they happen:
* `HessianAccumulator` counts input VECTORS (tokens), so ``hessian`` is a true average ``2/n Σ x xᵀ``; the
  reference counts batch entries. That is a constant factor: the codes are unchanged, the reported loss scales.
* Non-static group qparams are chosen on the group's fully error-updated columns (the reference reads ``W``,
  which lacks the updates made earlier in the current block).
"""

from __future__ import annotations

import warnings

import torch

from toolkit.quant.primitives import QuantConfig, choose_qparams, search_qparams
from toolkit.quant.quantized_weight import QuantizedWeight

_DAMP_RETRIES = 4  # damping is raised x10 this many times before giving up


class HessianAccumulator:
    """Running average ``H = 2/n Σ x xᵀ`` (float32 ``[in, in]``) over every input vector passed to `add`.

    With ``float_inputs`` (``[n, in]``: the float model's input of this layer for the same tokens, in the order
    `add` will see them), it also averages GPTAQ's cross term ``delta_xxt = 2/n Σ (x̃ - x) xᵀ`` (x̃ the float
    input, x the input through the already-quantized layers before; see `gptq_quantize`'s ``delta_xxt``).
    """

    def __init__(self, in_features: int | None = None, device: torch.device | str | None = None,
                 float_inputs: torch.Tensor | None = None):
        self.hessian: torch.Tensor | None = None
        self.samples = 0
        self.float_inputs = None if float_inputs is None else float_inputs.reshape(-1, float_inputs.shape[-1])
        self.delta_xxt: torch.Tensor | None = None
        if in_features is not None:
            self.hessian = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)

    def add(self, x: torch.Tensor) -> None:
        """Fold in inputs ``x [..., in]`` (every leading index is one sample).

        fp32 (or fp16/fp64) inputs: one in-place fp32 GEMM. bf16 inputs (GPTQ's bf16 calibration forwards): the
        batch's ``xᵀx`` is one bf16 GEMM (2-3x the fp32 rate where bf16 is native; the GEMM sums in fp32 and
        rounds each entry once, a relative 2^-9), added into the fp32 average.
        """
        x = x.detach().reshape(-1, x.shape[-1])
        if x.dtype != torch.bfloat16:
            x = x.to(torch.float32)
        if self.hessian is None:
            self.hessian = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
        if x.shape[1] != self.hessian.shape[0]:
            raise ValueError(f"inputs have {x.shape[1]} features, the Hessian has {self.hessian.shape[0]}")
        n = x.shape[0]
        if n == 0:
            return
        x = x.to(self.hessian.device)
        beta = self.samples / (self.samples + n)
        if self.float_inputs is not None:
            self._add_delta(x, beta, 2.0 / (self.samples + n))
        self.samples += n
        if x.dtype == torch.bfloat16:
            _add_symmetric_gram(self.hessian.mul_(beta), x, 2.0 / self.samples)
            return
        # H <- H * old/new + (2/new) xᵀx in one in-place GEMM (no temporaries of x or of an [in, in] product).
        self.hessian.addmm_(x.t(), x, beta=beta, alpha=2.0 / self.samples)

    def _add_delta(self, x: torch.Tensor, beta: float, alpha: float) -> None:
        """``delta_xxt <- beta delta_xxt + alpha (x̃ - x)ᵀ x`` for the next ``len(x)`` float input rows."""
        start = self.samples
        if start + x.shape[0] > self.float_inputs.shape[0]:
            raise ValueError(f"the layer got more inputs ({start + x.shape[0]} rows) than the float pass recorded "
                             f"({self.float_inputs.shape[0]})")
        x_float = self.float_inputs[start:start + x.shape[0]].to(device=x.device, dtype=x.dtype)
        if self.delta_xxt is None:
            self.delta_xxt = torch.zeros_like(self.hessian)
        delta = (x_float - x).t() @ x  # one GEMM in x's dtype (bf16 calibration: as the Hessian's)
        self.delta_xxt.mul_(beta).add_(delta.to(torch.float32), alpha=alpha)


def _add_symmetric_gram(h: torch.Tensor, x: torch.Tensor, alpha: float) -> None:
    """``h += alpha xᵀx`` for bf16 ``x [n, in]``. The product is symmetric: from 512 features on, the two diagonal
    half-blocks and ONE off-diagonal block are multiplied (3/4 of the work; its transpose fills the other),
    the same dot products as the full GEMM. Measured on 65,536 x 1536 bf16 rows: 1.41 s instead of 1.76 s."""
    n = x.shape[1]
    if n < 512:
        h.add_(x.t() @ x, alpha=alpha)
        return
    m = n // 2
    a, b = x[:, :m], x[:, m:]
    h[:m, :m].add_(a.t() @ a, alpha=alpha)
    h[m:, m:].add_(b.t() @ b, alpha=alpha)
    off = a.t() @ b
    h[:m, m:].add_(off, alpha=alpha)
    h[m:, :m].add_(off.t(), alpha=alpha)


def _inverse_cholesky(h: torch.Tensor, damp_percent: float, warn: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, L)``: the upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1`` and the lower one of that
    damped H itself; damping is raised x10 while either is not positive definite (with a warning if ``warn``)."""
    mean_diag = torch.mean(torch.diag(h))
    damp = damp_percent
    for attempt in range(_DAMP_RETRIES + 1):
        hd = h.clone()
        hd.diagonal().add_(damp * mean_diag)
        lower, info = torch.linalg.cholesky_ex(hd)
        if int(info) == 0:
            upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
            if int(info) == 0 and bool(torch.isfinite(upper).all()):
                return upper, lower
        if attempt == _DAMP_RETRIES:
            break
        damp = damp * 10 if damp > 0 else 0.01
        if warn:
            warnings.warn(f"GPTQ: the damped Hessian is not positive definite; retrying with damp_percent={damp:g}",
                          RuntimeWarning, stacklevel=3)
    raise RuntimeError(f"GPTQ: the Hessian is not positive definite even with damp_percent={damp:g}; check the "
                       f"calibration inputs (NaN/Inf, or far too few samples)")


def _asymmetric_shift(w: torch.Tensor, h: torch.Tensor, delta_xxt: torch.Tensor, dead: torch.Tensor,
                      damp_percent: float) -> torch.Tensor:
    """``W Δ H⁻¹``, H damped exactly as GPTQ's own solve damps it (raised the same way where H is not positive
    definite: a solve at the nominal damping would answer for a matrix GPTQ itself refused), Δ's dead columns
    zero: the least-squares step from W towards the weight whose output on the quantized-path inputs best
    matches the float model's."""
    delta = delta_xxt.clone()
    delta[:, dead] = 0.0
    _, lower = _inverse_cholesky(h, damp_percent, warn=False)  # GPTQ's own call below warns
    # H is symmetric: W Δ H⁻¹ = (H⁻¹ (W Δ)ᵀ)ᵀ
    return torch.cholesky_solve((w @ delta).t(), lower).t()


def _bounded_shift(w: torch.Tensor, h: torch.Tensor, delta_xxt: torch.Tensor, dead: torch.Tensor,
                   damp_percent: float, alpha: float, max_step: float | None) -> torch.Tensor:
    """``alpha W Δ H⁻¹``, its Frobenius norm at most ``max_step`` times W's (None: unbounded). The step solves a
    least-squares problem on the calibration inputs; where their H is nearly singular in some direction (an
    attention output with near-constant channels), the solve amplifies Δ there and the step can dwarf W itself
    (SmolLM2 block 7's o_proj: 3.3x W's norm, that layer's relative error 2.7; normal steps are 0.001-0.07 of
    W; docs/notes/2026-12-quantization-methods-what-was-tried.md "AWQ scales, then GPTAQ"). A step over the bound is solved again with H's damping raised x10 (a
    stronger ridge: it keeps the well-determined part of the step and drops the noise), up to `_DAMP_RETRIES`
    times; a step still over it is dropped (that layer gets plain GPTQ). Each is warned about."""
    norm_w = float(w.norm())
    damp, first = damp_percent, None
    for attempt in range(_DAMP_RETRIES + 1):
        step = alpha * _asymmetric_shift(w, h, delta_xxt, dead, damp)
        tried = damp
        ratio = float(step.norm()) / max(norm_w, 1e-30)
        first = ratio if first is None else first
        if max_step is None or ratio <= max_step:
            if attempt:
                warnings.warn(f"GPTAQ: the step for a {w.shape[0]}x{w.shape[1]} layer was {first:.3g} x its weight's "
                              f"norm, over gptaq_max_step={max_step:g}; solved with damp_percent={damp:g} "
                              f"({ratio:.3g} x)", RuntimeWarning, stacklevel=3)
            return step
        damp = damp * 10 if damp > 0 else 0.01
    warnings.warn(f"GPTAQ: the step for a {w.shape[0]}x{w.shape[1]} layer was {first:.3g} x its weight's norm and "
                  f"stayed over gptaq_max_step={max_step:g} up to damp_percent={tried:g}; that layer is quantized "
                  f"without it (plain GPTQ)", RuntimeWarning, stacklevel=3)
    return torch.zeros_like(w)


def _fake_quant(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int):
    """Codes and their values for one column, exactly the formulas of `primitives.quantize` / `dequantize`."""
    code = (torch.round(w / scale) + zero.to(torch.float32)).clamp(0, maxq)
    return code, (code - zero.to(torch.float32)) * scale


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, config: QuantConfig, *, damp_percent: float = 0.01,
                  block_size: int = 128, act_order: bool = False, static_groups: bool = False, mse: bool = False,
                  bias: torch.Tensor | None = None, delta_xxt: torch.Tensor | None = None,
                  asym_alpha: float = 0.25, asym_max_step: float | None = None) -> tuple[QuantizedWeight, float]:
    """GPTQ-quantize ``weight [out, in]`` given the input Hessian ``hessian [in, in]`` (see `HessianAccumulator`).

    Options (the reference's knobs): ``damp_percent`` — ``damp_percent * mean(diag H)`` is added to the diagonal
    (raised x10 with a warning while H is not positive definite); ``block_size`` — columns per lazy-batch block;
    ``act_order`` — quantize columns in order of descending ``diag(H)`` (``desc_act``); ``static_groups`` — choose
    every group's qparams up front on the (dead-column-zeroed) original weight instead of when the group starts;
    ``mse`` — choose each group's range by the reference quantizer's grid search (`search_qparams`: the range
    shrunk where that rounds the group with less error) instead of its min/max (`choose_qparams`).
    ``delta_xxt`` (GPTAQ / GPTQv2, Li et al. 2025: asymmetric calibration) — ``2/n Σ (x̃ - x) xᵀ`` from
    `HessianAccumulator` with ``float_inputs``: the layer is fitted to the FLOAT model's output ``W x̃`` from the
    inputs ``x`` it really gets (through the quantized layers before it), not to ``W x``. Since
    ``|W X̃ - Q X|² = |W X̃ - W* X|² + |(W* - Q) X|²`` for the least-squares ``W* = W + W Δ H⁻¹``, that is GPTQ
    run on ``W*`` with the same H; ``asym_alpha`` scales the step (0.25 by default, the paper's; the recipes use
    0.5: the full step scored worse on SmolLM2, docs/notes/2026-12-quantization-methods-what-was-tried.md "GPTAQ"). H is damped for the step as for GPTQ's solve;
    ``asym_max_step`` bounds the step's norm relative to W's (`_bounded_shift`: over it, solved again with more
    damping, else dropped).
    Input channels with ``H[i, i] == 0`` never fire: their weights become 0.

    Returns the `QuantizedWeight` (codes/scale/zero in the ORIGINAL column order; with ``act_order`` a ``g_idx``
    ``[in]`` int32 giving each original channel's group — ``channel // group_size`` with ``static_groups``, else the
    group of its quantization position) and the quantization loss ``Σ (w - q)² / (2 d²)`` of the reference.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    out, cols = weight.shape
    if tuple(hessian.shape) != (cols, cols):
        raise ValueError(f"hessian must have shape {(cols, cols)}, got {tuple(hessian.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if damp_percent < 0:
        raise ValueError(f"damp_percent must be >= 0, got {damp_percent}")
    gs = config.resolve_group_size(cols)
    n_groups = config.n_groups(cols)  # the last one ragged where gs does not divide cols
    w_all = weight.detach().to(torch.float32).clone()
    h = hessian.detach().to(device=w_all.device, dtype=torch.float32).clone()
    if not (torch.isfinite(w_all).all() and torch.isfinite(h).all()):
        raise ValueError("weight and hessian must be finite")

    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w_all[:, dead] = 0.0
    if delta_xxt is not None and asym_alpha > 0:
        w_all += _bounded_shift(w_all, h, delta_xxt.detach().to(h), dead, damp_percent, asym_alpha, asym_max_step)

    scale = torch.empty(out, n_groups, dtype=torch.float32, device=w_all.device)
    zero = torch.empty(out, n_groups, dtype=torch.int32, device=w_all.device)
    upfront = static_groups or n_groups == 1  # per-channel: one set of qparams for the whole row, as the reference
    qparams = search_qparams if mse else choose_qparams
    if upfront:
        scale[:], zero[:] = qparams(w_all, config)

    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(cols, device=w_all.device)
    w_all, h = w_all[:, perm], h[perm][:, perm]
    # group of each quantization position: the original channel's group for up-front qparams, else position // gs
    pos_group = perm // gs if upfront else torch.arange(cols, device=w_all.device) // gs
    col_config = QuantConfig(bits=config.bits, group_size=-1, symmetric=config.symmetric)

    hinv, _ = _inverse_cholesky(h, damp_percent)
    # The column loop works on the TRANSPOSED weight [cols, out]: a column, its codes and its error are contiguous
    # rows, and the rank-1 update of the block's later columns one contiguous `addr_` (2-3x faster than the
    # strided [out, cols] update on CPU). The arithmetic is the reference's, element for element.
    wt = w_all.t().contiguous()
    codes_t = torch.zeros_like(wt)
    loss = torch.zeros((), dtype=torch.float32, device=w_all.device)
    pos_group_list = pos_group.tolist()
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        w1 = wt[i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            g = pos_group_list[j]
            if not upfront and j % gs == 0:
                cols_now = w1[i:i + gs]
                if j + gs > i2:  # the group runs past this block: bring its later columns up to date first
                    later = wt[i2:j + gs] - hinv[i1:i2, i2:j + gs].t() @ err1
                    cols_now = torch.cat((cols_now, later), dim=0)
                s, z = qparams(cols_now.t(), col_config)
                scale[:, g], zero[:, g] = s[:, 0], z[:, 0]
            w = w1[i]
            code, q = _fake_quant(w, scale[:, g], zero[:, g], config.maxq)
            codes_t[j] = code
            e = err1[i]
            torch.sub(w, q, out=e).div_(hinv1[i, i])
            w1[i:].addr_(hinv1[i, i:], e, alpha=-1.0)  # the rank-1 update in place, no temporary
        loss += err1.square().sum() / 2
        wt[i2:] -= hinv[i1:i2, i2:].t() @ err1
    codes = codes_t.t()

    g_idx = None
    if act_order:
        invperm = torch.argsort(perm)
        codes = codes[:, invperm]
        g_idx = pos_group[invperm].to(torch.int32)
    qw = QuantizedWeight(codes=codes.to(torch.uint8), scale=scale, zero=zero, config=config,
                         bias=None if bias is None else bias.detach().clone(), g_idx=g_idx)
    return qw, float(loss)
