"""int8 x int8 GEMM for per-channel symmetric int8 weights: activations quantized per call ("dynamic"), oneDNN.

`QuantLinear`'s int8 prefill path (many rows). For a weight ``w = q * scale[:, None]`` (int8 codes q [out, in]):

    y = x @ w.T  ~=  a[:, None] / 63 * ((xq - 64) @ q.T) * scale[None, :]  +  x[:, O] @ w[:, O].T

* **Per-row (per-token) activation scales** ``a = max |x[i, :]|`` (outlier channels O excluded). The ops torch
  ships take one activation scale per tensor, so the rows are normalised before quantizing and the output rows
  multiplied back by ``a``. One scale for the whole tensor is unusable on LLM activations: SmolLM2's ``down_proj``
  inputs have rows 50-800x their RMS (massive activations on a few tokens), and per-tensor scales took perplexity
  from 17.0 to 48.7 (KL 1.09, see docs/notes/2026-12-runtime-kernels-native-decoder.md, "int8 prefill").
* **7-bit activations**, codes ``-63..63`` stored as ``uint8`` 1..127 with zero point 64. x86 without VNNI (AVX2,
  this machine) multiplies u8 x s8 with ``vpmaddubsw``, which adds two products into a *saturating* int16: full
  8-bit activations (0..255) against int8 weight codes up to 127 overflow it (2 * 255 * 127 > 32767) and the
  output is silently wrong (max error 12% of the output's range on random data, measured). 127 levels cannot
  (2 * 127 * 127 < 32767). This is what ``reduce_range=True`` does in torch's fbgemm dynamic linear.
* **Outlier channels** O: the `n_outliers` input channels with the largest |x| in this call are taken out of the
  int8 product (their codes set to the zero point) and added back in fp32 with the same int8 weight columns,
  dequantized (LLM.int8()'s decomposition). SmolLM2's attention inputs have channels ~20-30x the RMS that would
  otherwise set every row's scale. 16 channels (2.8% of 576) cut the end-to-end KL against fp32 from 0.098 to
  0.019 (0.003 for the exact int8 path) and the mean per-layer error from ~6% to ~1.8%.

The GEMM is ``torch.ops.onednn.qlinear_pointwise`` (the op torch's x86 inductor quantization lowers to; plain
tensors, no deprecated quantized dtypes) on a weight reordered by ``torch.ops.onednn.qlinear_prepack``. The reorder
is done per call into a temporary (~0.4 ms for 1536x576 here, ~2% of a 2048-row product), so no second copy of
the weight is held: the layer keeps 1 byte per weight. fbgemm's ``quantized::linear_dynamic`` runs the same
GEMM as fast but needs deprecated quantized tensors and a prepacked copy that takes ~12 ms to build (too slow per
call) and ~1.9 bytes per weight to hold (measured RSS), so it is not used.
"""

from __future__ import annotations

import torch

ACT_LEVELS = 63
"""Activation codes are -63..63 (7 bits): see the module docstring (no int16 saturation without VNNI)."""
ACT_ZERO_POINT = 64
_ROUND_OFFSET = ACT_ZERO_POINT + 0.5  # x * 63/a + 64.5 in [1.5, 127.5]; uint8 conversion truncates, so this rounds
MAX_OUTLIER_CHANNELS = 16

_available: bool | None = None


def outlier_channels(in_features: int) -> int:
    """How many input channels a layer computes in fp32: 16, or in/32 for narrow layers (tests' tiny models)."""
    return min(MAX_OUTLIER_CHANNELS, in_features // 32)


def available() -> bool:
    """Whether this torch has the oneDNN int8 ops and they give the right answer here (probed once)."""
    global _available
    if _available is None:
        _available = _probe()
    return _available


def _probe() -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")):
        return False
    gen = torch.Generator().manual_seed(0)
    w8 = torch.randint(-127, 128, (32, 64), generator=gen, dtype=torch.int8)
    scale = torch.rand(32, generator=gen) / 100 + 1e-3
    x = torch.randn(40, 64, generator=gen)
    try:
        y = linear(x, w8, scale, torch.zeros(32, dtype=torch.int32), 0)
    except RuntimeError:
        return False
    ref = x @ (w8.float() * scale[:, None]).t()
    return bool(((y - ref).norm() / ref.norm()) < 0.05)  # 7-bit per-row activations: ~1% on random data


def linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor,
           n_outliers: int) -> torch.Tensor | None:
    """``x @ (w8 * scale[:, None]).T`` for fp32 x [rows, in] (contiguous), int8 w8 [out, in], fp32 scale [out],
    ``zeros`` int32 [out] (the weight's zero points: all 0), activations quantized per row as described above.
    Returns None when x holds inf or nan (the caller then runs the exact path, which propagates them as fp32 does)."""
    # abs + amax: torch's inf-norm and aminmax reductions are ~10-30x slower on CPU (unvectorized)
    ax = x.abs()
    if n_outliers:
        col_max = ax.amax(0)
        if not bool(torch.isfinite(col_max).all()):
            return None
        idx = col_max.topk(n_outliers).indices
        ax.index_fill_(1, idx, 0.0)
    a = ax.amax(1, keepdim=True)
    del ax
    if not bool(torch.isfinite(a).all()):
        return None
    a.clamp_min_(torch.finfo(torch.float32).tiny)
    xf = torch.mul(x, ACT_LEVELS / a).add_(_ROUND_OFFSET)
    if n_outliers:
        xf.index_fill_(1, idx, float(ACT_ZERO_POINT))  # outlier columns (out of range here) quantize to zero
    xq = xf.to(torch.uint8)
    del xf
    packed = torch.ops.onednn.qlinear_prepack(w8, None)
    y = torch.ops.onednn.qlinear_pointwise(xq, 1.0 / ACT_LEVELS, ACT_ZERO_POINT, packed, scale, zeros, None,
                                           1.0, 0, torch.float32, "none", [], "")
    y.mul_(a)
    if n_outliers:
        y.addmm_(x.index_select(1, idx), (w8.index_select(1, idx).float() * scale[:, None]).t())
    return y
