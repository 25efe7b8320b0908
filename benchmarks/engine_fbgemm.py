"""fbgemm's packed fp16 GEMM against fp32 F.linear on the fp16 weight's fp32 copy, for one n x k layer on this machine
(median microseconds per call by rows): the table behind FBGEMM_MAX_ROWS in toolkit/engine/precision.py. Run from the
repository root:

    python benchmarks/engine_fbgemm.py
"""

import time

import torch
import torch.nn.functional as F


def bench(n: int = 1536, k: int = 576, rows=(1, 2, 4, 9, 16, 64, 128, 256, 2048)) -> None:
    """Print the FBGEMM_MAX_ROWS table for an n x k fp16 weight on this machine."""
    weight = (torch.randn(n, k) * 0.02).half()
    wide = weight.float()
    packed = torch.ops.quantized.linear_prepack_fp16(wide, None)

    def median_us(f, reps):
        for _ in range(3):
            f()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(reps):
                f()
            times.append((time.perf_counter() - start) / reps * 1e6)
        return sorted(times)[2]

    print(f"{n}x{k} fp16 weight, {torch.get_num_threads()} threads, median us per call")
    print("rows  wide-fp32  fbgemm-fp16  ratio")
    for m in rows:
        x = torch.randn(m, k)
        reps = max(3, 3000 // m)
        a = median_us(lambda: F.linear(x, wide), reps)
        b = median_us(lambda: torch.ops.quantized.linear_dynamic_fp16(x, packed), reps)
        print(f"{m:4d}  {a:9.0f}  {b:11.0f}  {a / b:5.2f}")


if __name__ == "__main__":
    bench()
