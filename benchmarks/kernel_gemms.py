"""specquant's GEMM kernels (toolkit/kernels/*_gemm.c) against the products they stand in for, on SmolLM2's shapes.
Run from the repository root, one or more of:

    python benchmarks/kernel_gemms.py half   # fp16 h16 kernel vs fbgemm's fp16 GEMM, weights beyond the caches
    python benchmarks/kernel_gemms.py int8   # int8 kernel vs torch's int8 (bf16) and the fp16 kernel, a decode step
    python benchmarks/kernel_gemms.py int4   # int4 n8 kernel vs torch's int4 (bf16) and fbgemm fp16, weights in cache
    python benchmarks/kernel_gemms.py vnni   # w4a8 / w8a8 VNNI kernel vs the fp32 int4 kernel and fbgemm fp16
    python benchmarks/kernel_gemms.py bf16   # bf16 b16 kernel vs the fp16 h16 kernel, weights beyond the caches

Each prints a table of medians; the kernels' module docstrings (toolkit/quant/half_native.py, int8_native.py,
int4_native.py, vnni.py, bf16_native.py) quote what it printed on this project's machine.
"""

import argparse
import statistics
import time
from typing import Callable

import torch

from toolkit.quant import bf16_native, half_native, int4_native, int8_native, vnni
from toolkit.timing import median_call_us


def _require(*kernels) -> None:
    """Exit with a message unless every one of the kernel modules loaded its library (the log says why not)."""
    missing = [k.__name__.rsplit(".", 1)[1] for k in kernels if not k.available()]
    if missing:
        raise SystemExit(f"not available here (no compiler, or the CPU lacks the kernel's instructions; see the "
                         f"log): {', '.join(missing)}")


def _alternating(calls: dict[str, Callable[[int], object]], reps: int) -> dict[str, float]:
    """Median seconds of each call over `reps` rounds, the calls alternating within a round; a call gets the round's
    index (to rotate its weights through copies beyond the caches)."""
    times = {name: [] for name in calls}
    for i in range(reps):
        for name, call in calls.items():
            start = time.perf_counter()
            call(i)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def half() -> None:
    """The fp16 kernel against fbgemm's fp16 GEMM, weights rotated through copies beyond the caches (median us of
    30 calls, alternating)."""
    _require(half_native)
    print(f"{'shape':>12} {'rows':>5} {'specquant h16':>14} {'fbgemm fp16':>12}")
    for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).mul_(0.05).half()
        copies = max(1, int(64e6 // (n * k * 2)))
        ours = [half_native.pack(w) for _ in range(copies)]
        theirs = [torch.ops.quantized.linear_prepack_fp16(w.float(), None) for _ in range(copies)]
        for m in (1, 5, 9, 17):
            x = torch.randn(m, k)
            t = _alternating({"ours": lambda i: half_native.linear(x, ours[i % copies], n),
                              "fbgemm": lambda i: torch.ops.quantized.linear_dynamic_fp16(x, theirs[i % copies])}, 30)
            print(f"{f'{n}x{k}':>12} {m:>5} {t['ours'] * 1e6:>12.0f} us {t['fbgemm'] * 1e6:>9.0f} us")


def int8(layers: int = 30, row_counts=(1, 6, 17), reps: int = 21) -> None:
    """One decode step's products of SmolLM2-135M's decoder (per layer: fused q,k,v 960x576, o 576x576, fused
    gate,up 3072x576, down 576x1536), weights streamed from memory: the int8 kernel against torch's int8 kernel (bf16
    activations) and specquant's fp16 GEMM (the float model's), the same shapes, alternating; median ms a step."""
    _require(int8_native)
    g = torch.Generator().manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * layers
    codes = [torch.randint(-127, 128, s, generator=g).to(torch.int8) for s in shapes]
    scales = [torch.rand(s[0], generator=g) * 0.01 + 1e-4 for s in shapes]
    ours = [int8_native.pack(w) for w in codes]
    halves = [half_native.pack(w.float() * s[:, None]) if half_native.available() else None
              for w, s in zip(codes, scales)]
    bf16_scales = [s.bfloat16() for s in scales]
    print(f"{torch.get_num_threads()} threads; {sum(w.numel() for w in codes) / 1e6:.1f}M weights a step; "
          f"median ms a step of {reps}")
    print(f"{'rows':>4} {'specquant int8':>15} {'torch int8 (bf16)':>18} {'specquant fp16':>15}")
    for m in row_counts:
        xs = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
        paths = {
            "int8": lambda i: [int8_native.linear(xs[w.shape[1]], p, s) for w, p, s in zip(codes, ours, scales)],
            "torch": lambda i: [torch.ops.aten._weight_int8pack_mm(xs[w.shape[1]].bfloat16(), w, s)
                                for w, s in zip(codes, bf16_scales)],
        }
        if half_native.available():
            paths["fp16"] = lambda i: [half_native.linear(xs[w.shape[1]], h, w.shape[0]) for w, h in zip(codes, halves)]
        ms = {name: t * 1e3 for name, t in _alternating(paths, reps).items()}
        print(f"{m:>4} {ms['int8']:>15.2f} {ms['torch']:>18.2f} {ms.get('fp16', float('nan')):>15.2f}")


def int4(shapes=((192, 576), (1536, 576), (576, 1536), (3072, 576), (49152, 576)), rows=(1, 4, 9, 17),
         group: int = 64, reps: int = 200) -> None:
    """Median microseconds per call: the int4 kernel, torch's int4 kernel (bf16 activations, its fast path) and
    fbgemm's fp16 GEMM (the engine's float path), same weights, one after another in this process."""
    _require(int4_native)
    g = torch.Generator().manual_seed(0)
    print(f"group {group}, {torch.get_num_threads()} threads; median us per call (weights in cache)")
    print(f"{'out x in':>12} {'rows':>4} {'specquant int4':>15} {'torch int4 (bf16)':>18} {'fbgemm fp16':>12}")
    for n, k in shapes:
        q = torch.randint(0, 16, (n, k), generator=g)
        s = torch.rand(n, k // group, generator=g) * 0.01 + 1e-3
        z = torch.randint(0, 16, (n, k // group), generator=g)
        w = ((q.view(n, -1, group) - z[..., None]) * s[..., None]).view(n, k)
        pc, ps, pz = int4_native.pack(q, s, z, group)
        tp = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        sz = torch.stack([s, (8 - z) * s], -1).transpose(0, 1).to(torch.bfloat16).contiguous()
        fb = torch.ops.quantized.linear_prepack_fp16(w, None)
        for m in rows:
            x = torch.randn(m, k, generator=g)
            ours = median_call_us(lambda: int4_native.linear(x, pc, ps, pz, group), reps)
            theirs = median_call_us(
                lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), tp, group, sz).float(), reps)
            half_us = median_call_us(lambda: torch.ops.quantized.linear_dynamic_fp16(x, fb), reps)
            print(f"{n:>5} x {k:<5} {m:>4} {ours:>15.0f} {theirs:>18.0f} {half_us:>12.0f}")


def vnni_w4a8(shapes=((960, 576), (3072, 576), (576, 1536), (49152, 576)), rows=(1, 5, 9), group: int = 64,
              reps: int = 200) -> None:
    """Median microseconds per call, one after another on the same weights (in cache): the fp32 int4 kernel (n8
    layout), the VNNI kernel at 4 and 8 bits, and fbgemm's fp16 GEMM (the engine's float path)."""
    _require(vnni, int4_native)
    g = torch.Generator().manual_seed(0)
    print(f"group {group}, {torch.get_num_threads()} threads; median us per call")
    print(f"{'out x in':>12} {'rows':>4} {'fp32 int4 (n8)':>15} {'w4a8':>6} {'w8a8':>6} {'fbgemm fp16':>12}")
    for n, k in shapes:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        q8 = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
        s = torch.rand(n, k // group, generator=g) * 0.01 + 1e-3
        z = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8)
        n8 = int4_native.pack(q, s, z, group)
        v4, v8 = vnni.pack(q, s, z, group), vnni.pack(q8, s, z, group, bits=8)
        fb = torch.ops.quantized.linear_prepack_fp16(torch.randn(n, k, generator=g) * 0.02, None)
        for m in rows:
            x = torch.randn(m, k, generator=g)
            fp32 = median_call_us(lambda: int4_native.linear(x, *n8, group), reps)
            w4 = median_call_us(lambda: vnni.linear(x, *v4, group), reps)
            w8 = median_call_us(lambda: vnni.linear(x, *v8, group, bits=8), reps)
            half_us = median_call_us(lambda: torch.ops.quantized.linear_dynamic_fp16(x, fb), reps)
            print(f"{n:>5} x {k:<5} {m:>4} {fp32:>15.0f} {w4:>6.0f} {w8:>6.0f} {half_us:>12.0f}")


def bf16() -> None:
    """The bf16 kernel against specquant's fp16 kernel, weights rotated through copies beyond the caches (median us
    of 30 calls, alternating)."""
    _require(bf16_native, half_native)
    print(f"{'shape':>12} {'rows':>5} {'fp16 (h16)':>11} {'bf16 (b16)':>11}")
    for n, k in [(960, 576), (3072, 576), (576, 1536), (49152, 576)]:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).mul_(0.05).half()
        copies = max(2, int(96e6 // (n * k * 2)))
        halves = [half_native.pack(w) for _ in range(copies)]
        ours = [bf16_native.pack(w) for _ in range(copies)]
        for m in (1, 6, 9, 12):
            x = torch.randn(m, k)
            t = _alternating({"h16": lambda i: half_native.linear(x, halves[i % copies], n),
                              "b16": lambda i: bf16_native.linear(x, ours[(i + copies // 2) % copies], n)}, 30)
            print(f"{f'{n}x{k}':>12} {m:>5} {t['h16'] * 1e6:>8.0f} us {t['b16'] * 1e6:>8.0f} us")


BENCHES = {"half": half, "int8": int8, "int4": int4, "vnni": vnni_w4a8, "bf16": bf16}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernels", nargs="+", choices=sorted(BENCHES), help="which kernels' tables to print")
    for name in parser.parse_args(argv).kernels:
        BENCHES[name]()


if __name__ == "__main__":
    main()
