"""specquant's own int8 GEMM for x86 CPUs with AVX2 (toolkit/quant/c/int8_gemm.c): symmetric per-channel int8
weights in torch's own int8pack layout (int8 [N, K] and fp32 scales [N], the buffers QuantLinear's ``"int8pack"``
layers already hold, so no second copy), fp32 activations and accumulation; built on first use (`toolkit.cbuild`)
and called through ctypes.

Why: torch's ``aten._weight_int8pack_mm`` is vectorized only for bf16 activations, which this AVX2 CPU widens in
software. Measured for a 1536x576 layer at one row, weights in cache, 2 threads (`python -m
toolkit.quant.int8_native`): this kernel ~27 us, torch's int8 ~42 us, fbgemm fp16 ~39 us. Products equal the fp32
weight's to fp32 rounding (no bf16 rounding of the activations), and a row's result never depends on the rows
beside it (the kernel's docstring says why), as speculative verification needs.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from pathlib import Path

import torch

from toolkit import cbuild

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "c" / "int8_gemm.c"
# -ffp-contract=off: the compiler fuses no multiply-add on its own (the kernel's FMAs are explicit), so every tiling
# instance rounds the same way and a row's result does not depend on the rows beside it
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
K_MULTIPLE = 8  # in_features must be a multiple of this (one AVX2 register of codes)


def load(flags: tuple[str, ...] = tuple(FLAGS)):
    """Build and load the library; None, with a warning, where it cannot be built or the CPU lacks AVX2."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return cbuild.load_kernel(SOURCE, "int8-gemm", list(flags), "int8 GEMM kernel",
                              "int8 layers run torch's int8 kernel (slower on AVX2)", log,
                              {"sq_int8_linear": [p, i64, i64, p, p, p, i64, p]}, _self_test)


def _self_test(lib) -> str | None:
    x, w, s, y = torch.ones(1, 8), torch.full((2, 8), 3, dtype=torch.int8), torch.full((2,), 0.5), torch.empty(1, 2)
    rc = lib.sq_int8_linear(x.data_ptr(), 1, 8, w.data_ptr(), s.data_ptr(), None, 2, y.data_ptr())
    return None if rc == 0 and torch.equal(y, torch.full((1, 2), 12.0)) else f"rc {rc}"


@lru_cache(maxsize=1)
def kernel():
    """The loaded library (function ``sq_int8_linear``), or None: see `load`."""
    return load()


def available() -> bool:
    return kernel() is not None


def linear(x2: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x2 [M, K] @ (w * scale[:, None]).T (+ bias) in fp32: w int8 [N, K] contiguous, scale fp32 [N],
    bias fp32 [N] or None (added in the kernel). Call only where `available()`; K % 8 == 0."""
    if x2.dtype != torch.float32:
        x2 = x2.float()
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m, k = x2.shape
    n = w.shape[0]
    if k != w.shape[1] or k % K_MULTIPLE:
        raise ValueError(f"x has {k} features, the int8 weight {w.shape[1]} (a multiple of {K_MULTIPLE} needed)")
    y = torch.empty(m, n)
    if m:
        rc = kernel().sq_int8_linear(x2.data_ptr(), m, k, w.data_ptr(), scale.data_ptr(),
                                     None if bias is None else bias.data_ptr(), n, y.data_ptr())
        if rc:
            raise ValueError(f"the int8 GEMM kernel refused [{n}, {k}] (rc {rc})")
    return y


def _bench(shapes=((192, 576), (1536, 576), (576, 1536), (49152, 576)), rows=(1, 4, 9, 17), reps: int = 200) -> None:
    """Median microseconds per call: this kernel, torch's int8 kernel (bf16 activations, its fast path) and fbgemm's
    fp16 GEMM (the engine's float path), same weights, one after another in this process."""
    from toolkit.engine.timing import median_call_us

    def timed(f):
        return median_call_us(f, reps)

    if not available():
        raise SystemExit("the int8 GEMM kernel is not available here (see the log)")
    g = torch.Generator().manual_seed(0)
    print(f"{torch.get_num_threads()} threads; median us per call (weights in cache)")
    print(f"{'out x in':>12} {'rows':>4} {'specquant int8':>15} {'torch int8 (bf16)':>18} {'fbgemm fp16':>12}")
    for n, k in shapes:
        w = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8)
        s = torch.rand(n, generator=g) * 0.01 + 1e-4
        sb = s.bfloat16()
        fb = torch.ops.quantized.linear_prepack_fp16(w.float() * s[:, None], None)
        for m in rows:
            x = torch.randn(m, k, generator=g)
            ours = timed(lambda: linear(x, w, s))
            theirs = timed(lambda: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), w, sb).float())
            half = timed(lambda: torch.ops.quantized.linear_dynamic_fp16(x, fb))
            print(f"{n:>5} x {k:<5} {m:>4} {ours:>15.0f} {theirs:>18.0f} {half:>12.0f}")


if __name__ == "__main__":
    _bench()
