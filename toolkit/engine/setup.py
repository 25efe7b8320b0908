"""Turn an `engine` config into a ready model: threads set, weights loaded and cast for the engine."""

import os

import torch

from toolkit.engine.precision import DTYPE_NAMES, prepare_model, resolve_dtype
from toolkit.errors import InputError


def configure_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (None = all cores); returns the count in force."""
    count = threads or os.cpu_count() or 1
    if count < 1:
        raise InputError(f"engine.threads must be >= 1, got {threads}", "use null for all cores")
    torch.set_num_threads(count)
    return count


def load_engine_model(name: str, engine_cfg):
    """Load `name` (registry name, directory, hub id) and prepare it for the engine; returns a LoadedModel."""
    from toolkit.models import load_model

    configure_threads(engine_cfg.threads)
    loaded = load_model(name, dtype=torch.float32)
    loaded.dtype = prepare_engine_model(loaded.model, engine_cfg)
    return loaded


def prepare_engine_model(model, engine_cfg) -> torch.dtype:
    """Move and cast `model` (in place) as the engine config says; returns the dtype it now runs in."""
    if engine_cfg.device != "cpu" and not torch.cuda.is_available():
        raise InputError(f"engine.device={engine_cfg.device} but no CUDA device is available", "use engine.device=cpu")
    dtype = resolve_dtype(engine_cfg.dtype, engine_cfg.device)
    prepare_model(model.to(engine_cfg.device), dtype)
    if engine_cfg.get("compile"):
        compile_decode(model)
    return dtype


def compile_decode(model) -> None:
    """torch.compile the model's forward with dynamic shapes, so one graph serves every cache length."""
    model.forward = torch.compile(model.forward, dynamic=True)


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype))
