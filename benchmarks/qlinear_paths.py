"""QuantLinear's product paths side by side for one n x k layer on this machine: the low-bit kernels against
dequantize + fp32 (and bf16) F.linear, int8 x int8, and fp32 F.linear on a float weight; microseconds per call, the
best of 20. The tables in toolkit/quant/qlinear.py's docstring and the thresholds there (KERNEL_MAX_ROWS,
INT8_DYNAMIC_MIN_ROWS, INT8_NATIVE_MAX_ROWS) come from it. Run from the repository root:

    OMP_NUM_THREADS=1 python benchmarks/qlinear_paths.py
"""

import time

import torch
import torch.nn.functional as F

from toolkit.quant import int8_dynamic
from toolkit.quant.primitives import QuantConfig, choose_qparams, quantize
from toolkit.quant.qlinear import QuantLinear
from toolkit.quant.quantized_weight import QuantizedWeight


def bench(n: int = 1536, k: int = 576, rows=(1, 4, 8, 16, 32, 48, 64, 128, 256, 512, 1024, 2048),
          reps: int = 20) -> None:
    """Print the table in the module docstring for an n x k layer on this machine: microseconds per call, the best
    of `reps` (on a shared machine the best is the least disturbed; the median drifts with other jobs)."""
    def timed(f):
        f()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t0)
        return best * 1e6

    w = torch.randn(n, k)
    table = {}
    for bits, gs in ((4, 64), (8, -1)):
        config = QuantConfig(bits=bits, group_size=gs)
        scale, zero = choose_qparams(w, config)
        layer = QuantLinear.from_quantized(QuantizedWeight(quantize(w, scale, zero, config), scale, zero, config))
        z = torch.zeros(n, dtype=torch.int32)
        for m in rows:
            x = torch.randn(m, k)
            act = "fp32" if layer._native else "bf16"
            table.setdefault(f"int{bits} {layer.kernel} kernel ({act} act)", []).append(
                timed(lambda: layer._kernel(x).float()))
            table.setdefault(f"int{bits} dequant + fp32 F.linear", []).append(
                timed(lambda: F.linear(x, layer._weight_block(0, n, torch.float32))))
            if bits == 4:  # a bf16 prompt pass's path (prefill_bf16)
                table.setdefault("int4 dequant + bf16 F.linear", []).append(timed(
                    lambda: F.linear(x.to(torch.bfloat16), layer._weight_block(0, n, torch.bfloat16)).float()))
            if layer.kernel == "int8pack" and int8_dynamic.available():
                table.setdefault("int8 x int8 (7-bit act, 16 outl.)", []).append(timed(
                    lambda: int8_dynamic.linear(x, layer.int8_rows(), layer.scale, z,
                                                int8_dynamic.outlier_channels(k))))
            if bits == 8:
                table.setdefault("fp32 F.linear, float weight", []).append(timed(lambda: F.linear(x, w)))
    print(f"{n}x{k} layer, {torch.get_num_threads()} threads, best of {reps}, microseconds")
    print(f"{'rows':34s}" + "".join(f"{m:>7d}" for m in rows))
    for label, values in table.items():
        print(f"{label:34s}" + "".join(f"{v:7.0f}" for v in values))


if __name__ == "__main__":
    bench()
