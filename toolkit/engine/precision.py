"""Which dtype the engine runs in, and how to make bf16 fast on CPUs that have no bf16 arithmetic.

Decode is memory-bound: bf16 weights halve the bytes each step reads, so bf16 helps decode on any CPU. Prefill is
compute-bound: on a CPU without AVX512-BF16 or AMX (e.g. AMD Zen 3, AVX2 only), torch's bf16 matmul runs one row at
a time and a 128-token prefill is ~6x slower than fp32. `Bf16StorageLinear` keeps bf16 weights (decode reads half
the bytes) but upcasts weight and input to fp32 for matmuls with several rows, where that is faster.
"""

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from toolkit.errors import InputError

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# Below this many rows the native bf16 kernel (a gemv) wins; above, upcasting to fp32 wins (measured on Zen 3:
# 1 row 98 vs 189 us, 4 rows 368 vs 352 us, 128 rows 11.5 vs 1.75 ms for a 1536x576 weight).
UPCAST_MIN_ROWS = 4


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """'auto' is bf16 (half the bytes per decode step); otherwise the named dtype."""
    if name == "auto":
        return torch.bfloat16
    if name not in DTYPES:
        raise InputError(f"unknown dtype {name!r}", f"use one of: auto, {', '.join(sorted(set(DTYPE_NAMES.values())))}")
    return DTYPES[name]


class Bf16StorageLinear(torch.nn.Linear):
    """nn.Linear with bf16 weights that computes multi-row products in fp32 (swapped in by class, so the
    parameters, their ties and state-dict names stay the module's own)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows < UPCAST_MIN_ROWS:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def prepare_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast `model` to `dtype` for inference; on CPUs without bf16 arithmetic, swap Linear layers so bf16
    prefill runs in fp32. Returns the same module, in eval mode."""
    model.to(dtype).eval()
    device = next(model.parameters()).device
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_native_bf16():
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                module.__class__ = Bf16StorageLinear
    return model
