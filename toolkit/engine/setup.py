"""Turn an `engine` config into a ready model: threads set, weights loaded and cast for the engine."""

import os

import torch

from toolkit.engine.precision import Precision, prepare_model, resolve_precision
from toolkit.errors import InputError


def configure_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (None = all cores); returns the count in force."""
    count = threads or os.cpu_count() or 1
    if count < 1:
        raise InputError(f"engine.threads must be >= 1, got {threads}", "use null for all cores")
    torch.set_num_threads(count)
    return count


def load_engine_model(name: str, engine_cfg):
    """Load `name` (registry name, directory, hub id) and prepare it for the engine; returns a LoadedModel whose
    `precision` says what it runs in."""
    from toolkit.models import load_model

    configure_threads(engine_cfg.threads)
    loaded = load_model(name, dtype=torch.float32)
    loaded.precision = prepare_engine_model(loaded.model, engine_cfg)
    return loaded


def prepare_engine_model(model, engine_cfg) -> Precision:
    """Move and cast `model` (in place) as the engine config says; returns its precision."""
    if engine_cfg.device != "cpu" and not torch.cuda.is_available():
        raise InputError(f"engine.device={engine_cfg.device} but no CUDA device is available", "use engine.device=cpu")
    precision = resolve_precision(engine_cfg.dtype, engine_cfg.get("weight_dtype", "auto"), engine_cfg.device)
    prepare_model(model.to(engine_cfg.device), precision)
    if engine_cfg.get("compile"):
        compile_decode(model)
    return precision


def compile_decode(model) -> None:
    """torch.compile the forward that decode steps use (prefill stays eager: one graph fewer to build), with
    dynamic shapes so one graph serves every cache length. The first decode step pays the compilation."""
    model.specquant_decode_forward = torch.compile(model.forward, dynamic=True)
