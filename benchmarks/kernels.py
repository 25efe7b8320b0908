"""Low-bit CPU matmul kernels against float linear, per weight shape, interleaved in one run.

    python -m benchmarks.kernels [--rows 1 4 128] [--repeats 7] [--group-size 64] [--out kernels.json]

Every variant takes float32 activations and returns float32 (our engine's activations), so casts are part of the
cost, as they would be in a layer: fp32 ``F.linear``; fp16-weight gemv (``F.linear(x.half(), w16).float()``, the
engine's current decode path); bf16 ``F.linear``; ``_weight_int8pack_mm`` run in fp32 / bf16 / fp16; and
``_weight_int4pack_mm_for_cpu`` run in fp32 / bf16 / fp16 (raw ops, plus the bf16 path through the
``int4_weight_linear`` wrapper to show its Python overhead).

Decode (M=1) is memory-bound only if the weights come from DRAM, so each variant cycles through many distinct
copies of each weight: every variant's rotating set is at least ``--rotate-mb`` (default 96 MB, 3x this machine's
32 MB L3) in its own format. Rounds shuffle the variant order; a variant's per-call time in a round is a batch of
calls lasting about ``--batch-ms``; the table shows medians over rounds, and speedups are medians of per-round
ratios (measured side by side, so a concurrent load on the machine shifts both sides).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from toolkit.quant.kernels import int4_weight_linear

SHAPES: dict[str, tuple[int, int]] = {  # name: (out_features, in_features)
    "smol q/o 576x576": (576, 576),
    "smol k/v 192x576": (192, 576),
    "smol gate/up 1536x576": (1536, 576),
    "smol down 576x1536": (576, 1536),
    "qwen q/o 896x896": (896, 896),
    "qwen gate/up 4864x896": (4864, 896),
}

int8_mm = torch.ops.aten._weight_int8pack_mm
int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
int4_pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu


@dataclass
class Variant:
    name: str
    fmt: str  # which weight copies it reads: fp32, fp16, bf16, int8, int4
    dtype: torch.dtype  # the dtype the op runs in (scales are stored in it)
    call: Callable  # (x_fp32, copy) -> y_fp32


BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
VARIANTS = [
    Variant("fp32 linear", "fp32", F32, lambda x, c: F.linear(x, c["w"])),
    Variant("fp16-weight gemv", "fp16", F16, lambda x, c: F.linear(x.half(), c["w"]).float()),
    Variant("bf16 linear", "bf16", BF16, lambda x, c: F.linear(x.bfloat16(), c["w"]).float()),
    Variant("int8 · fp32 act", "int8", F32, lambda x, c: int8_mm(x, c["q"], c["s"][F32])),
    Variant("int8 · bf16 act", "int8", BF16, lambda x, c: int8_mm(x.bfloat16(), c["q"], c["s"][BF16]).float()),
    Variant("int8 · fp16 act", "int8", F16, lambda x, c: int8_mm(x.half(), c["q"], c["s"][F16]).float()),
    Variant("int4 · fp32 act", "int4", F32, lambda x, c: int4_mm(x, c["q"], c["g"], c["sz"][F32])),
    Variant("int4 · bf16 act", "int4", BF16,
            lambda x, c: int4_mm(x.bfloat16(), c["q"], c["g"], c["sz"][BF16]).float()),
    Variant("int4 · fp16 act", "int4", F16, lambda x, c: int4_mm(x.half(), c["q"], c["g"], c["sz"][F16]).float()),
    Variant("int4 · bf16 wrapper", "int4", BF16, lambda x, c: int4_weight_linear(x, c["q"], c["sz"][BF16], c["g"])),
]
BASELINES = ("fp32 linear", "fp16-weight gemv")
BYTES_PER_WEIGHT = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "int4": 0.5}


def weight_bytes(fmt: str, dtype: torch.dtype, n: int, k: int, group_size: int) -> int:
    """Bytes one call reads from the weight: the values plus the int8 scales / int4 scales-and-zeros."""
    size = torch.tensor([], dtype=dtype).element_size()
    extra = {"int8": n * size, "int4": (k // group_size) * n * 2 * size}.get(fmt, 0)
    return int(n * k * BYTES_PER_WEIGHT[fmt]) + extra


def make_copies(fmt: str, n: int, k: int, count: int, group_size: int) -> list[dict]:
    """`count` distinct weights of one format. Values are random (kernel speed does not depend on them)."""
    copies = []
    for _ in range(count):
        if fmt in ("fp32", "fp16", "bf16"):
            w = torch.randn(n, k) * 0.02
            copies.append({"w": w if fmt == "fp32" else w.to(F16 if fmt == "fp16" else BF16)})
        elif fmt == "int8":
            s = torch.rand(n) * 1e-3 + 1e-4
            copies.append({"q": torch.randint(-127, 128, (n, k), dtype=torch.int8),
                           "s": {dt: s.to(dt) for dt in (F32, BF16, F16)}})
        else:
            sz = torch.stack([torch.rand(k // group_size, n) * 1e-3, torch.randn(k // group_size, n) * 1e-3], -1)
            copies.append({"q": int4_pack(torch.randint(0, 16, (n, k), dtype=torch.int32), 1), "g": group_size,
                           "sz": {dt: sz.to(dt).contiguous() for dt in (F32, BF16, F16)}})
    return copies


def bench_shape(n: int, k: int, rows: list[int], variants: list[Variant], repeats: int, batch_s: float,
                rotate_bytes: float, group_size: int, rng: random.Random, log=print) -> dict:
    count = max(4, math.ceil(rotate_bytes / (n * k * BYTES_PER_WEIGHT["int4"])))
    fmts = sorted({v.fmt for v in variants})
    t0 = time.perf_counter()
    copies = {fmt: make_copies(fmt, n, k, count, group_size) for fmt in fmts}
    log(f"  {n}x{k}: {count} copies per format ({count * n * k * 4 / 2**20:.0f} MB fp32 ... "
        f"{count * n * k / 2 / 2**20:.0f} MB int4), built in {time.perf_counter() - t0:.1f}s")
    cursor = {v.name: 0 for v in variants}

    def run(v: Variant, x: torch.Tensor, calls: int) -> float:
        pool = copies[v.fmt]
        i = cursor[v.name]
        start = time.perf_counter()
        for _ in range(calls):
            v.call(x, pool[i])
            i = (i + 1) % len(pool)
        elapsed = time.perf_counter() - start
        cursor[v.name] = i
        return elapsed / calls

    out = {}
    for m in rows:
        x = torch.randn(m, k)
        est = {v.name: run(v, x, 2) for v in variants}  # warm-up, and the batch size estimate
        calls = {name: max(1, min(20 * count, round(batch_s / t))) for name, t in est.items()}
        times = {v.name: [] for v in variants}
        for _ in range(repeats):
            order = list(variants)
            rng.shuffle(order)
            for v in order:
                times[v.name].append(run(v, x, calls[v.name]))
        result = {}
        for v in variants:
            t = times[v.name]
            med = statistics.median(t)
            nbytes = weight_bytes(v.fmt, v.dtype, n, k, group_size)
            result[v.name] = {
                "us_per_call": med * 1e6,
                "us_all": [s * 1e6 for s in t],
                "calls_per_round": calls[v.name],
                "weight_bytes": nbytes,
                "gb_per_s": nbytes / med / 1e9,
                **{f"speedup_vs_{b}": statistics.median(tb / tv for tb, tv in zip(times[b], t))
                   for b in BASELINES if b in times},
            }
        out[m] = result
    del copies
    return out


def summarize(results: dict, variants: list[Variant], rows: list[int]) -> dict:
    """Geometric-mean speedup of each variant over the shapes, per M."""
    summary = {}
    for m in rows:
        summary[m] = {}
        for v in variants:
            cells = [r[m][v.name] for r in results.values() if v.name in r[m]]
            summary[m][v.name] = {
                f"geomean_speedup_vs_{b}": math.exp(statistics.fmean(math.log(c[f"speedup_vs_{b}"]) for c in cells))
                for b in BASELINES if all(f"speedup_vs_{b}" in c for c in cells)
            }
            summary[m][v.name]["total_us_all_shapes"] = sum(c["us_per_call"] for c in cells)
    return summary


def print_tables(results: dict, summary: dict, variants: list[Variant], rows: list[int]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(200, Console().width))
    for m in rows:
        table = Table(title=f"M = {m} rows: µs per call (median) · GB/s of weight bytes · speedup vs fp32 linear / "
                            f"vs fp16-weight gemv (median of per-round ratios)")
        table.add_column("variant")
        for name in results:
            table.add_column(name, justify="right")
        for v in variants:
            cells = []
            for name in results:
                c = results[name][m].get(v.name)
                cells.append("-" if c is None else
                             f"{c['us_per_call']:.1f} µs · {c['gb_per_s']:.1f} GB/s\n"
                             f"×{c['speedup_vs_fp32 linear']:.2f} / ×{c['speedup_vs_fp16-weight gemv']:.2f}")
            table.add_row(v.name, *cells)
        console.print(table)
    table = Table(title="Summary: geomean speedup over the shapes vs fp32 linear / vs fp16-weight gemv; "
                        "sum of µs per call over all shapes")
    table.add_column("variant")
    for m in rows:
        table.add_column(f"M={m}", justify="right")
    for v in variants:
        cells = []
        for m in rows:
            s = summary[m][v.name]
            cells.append(f"×{s['geomean_speedup_vs_fp32 linear']:.2f} / "
                         f"×{s['geomean_speedup_vs_fp16-weight gemv']:.2f} · {s['total_us_all_shapes']:.0f} µs")
        table.add_row(v.name, *cells)
    console.print(table)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 128], help="activation rows M")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), metavar="SHAPE")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds per (shape, M)")
    parser.add_argument("--batch-ms", type=float, default=40.0, help="target time of one variant's batch of calls")
    parser.add_argument("--rotate-mb", type=float, default=96.0,
                        help="minimum size of each variant's rotating set of weight copies (>> L3 for decode)")
    parser.add_argument("--group-size", type=int, default=64, help="int4 group size (64 divides every shape)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    from toolkit.cpu import model as cpu_model
    from toolkit.machine import measure_memory_bandwidth

    bandwidth = measure_memory_bandwidth(gib=0.5, repeats=5)
    print(f"{cpu_model()} · torch {torch.__version__} · capability {torch.backends.cpu.get_cpu_capability()} · "
          f"{torch.get_num_threads()} threads · read bandwidth {bandwidth / 1e9:.1f} GB/s")

    results = {}
    started = time.perf_counter()
    for name in args.shapes:
        n, k = SHAPES[name]
        variants = [v for v in VARIANTS if v.fmt != "int4" or (k % args.group_size == 0 and n % 16 == 0)]
        results[name] = bench_shape(n, k, args.rows, variants, args.repeats, args.batch_ms / 1e3,
                                    args.rotate_mb * 2**20, args.group_size, rng)
    print(f"measured in {time.perf_counter() - started:.0f}s")
    summary = summarize(results, VARIANTS, args.rows)
    print_tables(results, summary, VARIANTS, args.rows)

    report = {
        "machine": {"cpu": cpu_model(), "torch": torch.__version__,
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "threads": torch.get_num_threads(), "read_bandwidth_gb_s": bandwidth / 1e9},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "shapes": {name: SHAPES[name] for name in args.shapes},
        "results": {name: {str(m): r for m, r in per_m.items()} for name, per_m in results.items()},
        "summary": {str(m): s for m, s in summary.items()},
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
