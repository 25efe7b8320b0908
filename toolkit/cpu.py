"""What this CPU can run, read once: its flags, its model name, and the ISA level specquant's C kernels are built for.

ISA levels, lowest first (docs/kernels.md):

* ``portable``: no vector extensions in specquant's C kernels; those that need AVX2 do not load and their torch
  fallbacks run (a test level: x86 CPUs without AVX2 predate 2013).
* ``avx2``: AVX2 + FMA + F16C (x86-64-v3: AMD Zen 1-3, Intel Haswell and later, most laptops).
* ``avx512``: everything this CPU has, but AMX (AVX512F/BW/VL, and VNNI / BF16 where present).
* ``amx``: everything, the AMX tile unit included (Intel Sapphire Rapids and later).

The level defaults to the best this CPU has. ``SPECQUANT_ISA=avx2`` (or ``portable``, ``avx512``) selects a lower one
for the whole process: the kernels are compiled for it (their own build cache entry) and every capability check
(`has`, `flags`) answers as that CPU would, so an AVX512 machine runs and tests exactly what an AVX2-only machine
runs. `environment` gives the variables that also hold torch's own kernels to that level, for a child process.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

from toolkit.errors import InputError

ISA_ENV = "SPECQUANT_ISA"
LEVELS = ("portable", "avx2", "avx512", "amx")

# what a level needs from the CPU (a level is available when the CPU has all of it)
_NEEDS = {
    "portable": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}),
    "amx": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "amx_tile", "amx_bf16"}),
}
# compiler flags per level: x86-64-v3 is exactly AVX2 + FMA + F16C (+ BMI, MOVBE), what an AVX2-only CPU has
_MARCH = {
    "portable": ["-march=x86-64", "-mtune=generic"],
    "avx2": ["-march=x86-64-v3"],
    "avx512": ["-march=native", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"],
    "amx": ["-march=native"],
}
# torch's own dispatch held to the same level in a child process: ATen's kernels, oneDNN's and fbgemm's. At the
# portable level torch stays at AVX2 (fbgemm needs it): that level tests specquant's fallbacks, not a pre-AVX2 torch
_TORCH_ENV = {
    "portable": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "amx": {},
}


@functools.cache
def _cpuinfo() -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("flags", "model name") and key not in fields:
                fields[key] = value.strip()
    except OSError:
        pass
    return fields


def hardware_flags() -> frozenset[str]:
    """The CPU's own flags, as /proc/cpuinfo lists them (empty where there is none)."""
    return frozenset(_cpuinfo().get("flags", "").split())


def model() -> str:
    """The CPU's model name."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def available_levels() -> tuple[str, ...]:
    """Every level this CPU can run, lowest first."""
    if not is_x86():
        return ("portable",)
    hw = hardware_flags()
    return tuple(level for level in LEVELS if _NEEDS[level] <= hw)


@functools.cache
def isa() -> str:
    """The level this process runs at: $SPECQUANT_ISA, else the best this CPU has."""
    best = available_levels()[-1]
    want = os.environ.get(ISA_ENV, "").strip().lower()
    if not want or want == "native":
        return best
    if want not in LEVELS:
        raise InputError(f"{ISA_ENV}={want!r} is not an ISA level", f"use one of {', '.join(LEVELS)} (or unset it)")
    if want not in available_levels():
        raise InputError(f"{ISA_ENV}={want} needs CPU features this CPU lacks "
                         f"({', '.join(sorted(_NEEDS[want] - hardware_flags()))})",
                         f"use one of {', '.join(available_levels())}")
    return want


@functools.cache
def flags() -> frozenset[str]:
    """The CPU flags as the selected level sees them: the hardware's, less every extension above the level."""
    hw, level = hardware_flags(), isa()
    if level == "amx":
        return hw
    drop = {f for f in hw if f.startswith("amx")}
    if level in ("avx2", "portable"):
        drop |= {f for f in hw if f.startswith("avx512") or f in ("avx_vnni", "avx_vnni_int8", "avx_ifma")}
    if level == "portable":
        drop |= {f for f in hw if f.startswith(("avx", "fma", "f16c", "sse4", "bmi"))}
    return hw - drop


def has(*names: str) -> bool:
    """Whether the selected level has every named flag (as /proc/cpuinfo spells them: avx2, avx512f, amx_bf16...)."""
    return set(names) <= flags()


def native_bf16() -> bool:
    """bf16 arithmetic in hardware (AVX512-BF16 or AMX) at the selected level."""
    return has("avx512_bf16") or has("amx_bf16")


def native_matmul(dtype, device) -> bool:
    """Whether a matmul in `dtype` on `device` runs at full speed: fp32 anywhere, any dtype off the CPU, bf16 where
    the CPU multiplies it natively."""
    import torch

    return dtype == torch.float32 or device.type != "cpu" or (dtype == torch.bfloat16 and native_bf16())


def march(level: str | None = None) -> list[str]:
    """The compiler's target flags for `level` (default: the selected level)."""
    if not is_x86():
        return []
    return list(_MARCH[level or isa()])


def with_level(flags: list[str] | tuple[str, ...], level: str) -> list[str]:
    """A kernel's compiler flags retargeted at `level` (tests build a lower level's kernel beside this one)."""
    return [f for f in flags if not f.startswith(("-march=", "-mtune=", "-mno-amx"))] + march(level)


def environment(level: str) -> dict[str, str]:
    """Environment variables that run a child process at `level`: specquant's kernels and torch's own."""
    if level not in LEVELS:
        raise InputError(f"{level!r} is not an ISA level", f"use one of {', '.join(LEVELS)}")
    return {ISA_ENV: level, **_TORCH_ENV[level]}


def describe() -> dict:
    """The facts a result records: the level the kernels ran at, the CPU's best, and the flags that decide paths."""
    keys = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    return {"isa": isa(), "isa_best": available_levels()[-1],
            "cpu_flags": [k for k in keys if k in hardware_flags()]}
