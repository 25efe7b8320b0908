"""Facts about the machine a measurement ran on, and the two numbers that bound LLM latency on it:
memory bandwidth (decode reads every weight per token) and matmul throughput (prefill is compute-bound)."""

import os
import platform
import time

import psutil
import torch

from toolkit import cpu


def measure_memory_bandwidth(gib: float = 0.5, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of `repeats` sums over a buffer far larger than the caches."""
    buffer = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    buffer.sum()  # touch every page once so page faults are not timed
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def measure_matmul_flops(n: int = 1024, dtype=torch.float32, repeats: int = 5) -> float:
    """Dense matmul throughput in FLOP/s (best of `repeats`)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def machine_facts(measure: bool = True) -> dict:
    """What a result needs to be reproduced: CPU, cores, memory, threads, library versions, and (if `measure`)
    this run's measured bandwidth and matmul throughput."""
    import transformers

    facts = {
        "cpu": cpu.model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "native_bf16": cpu.native_bf16(),
        "avx512": cpu.has("avx512f"),
        "amx_bf16": cpu.has("amx_bf16"),  # engine.native_dot=bf16 then runs on the tile unit (bf16_native)
        **cpu.describe(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    if measure:
        facts["memory_bandwidth_gbs"] = measure_memory_bandwidth() / 1e9
        facts["matmul_fp32_gflops"] = measure_matmul_flops() / 1e9
    return facts
