"""The model layer: which models exist (registry), the checked cache of converted checkpoints (cache), getting
them into it (fetch: packages -> gguf -> cache), loading them (load).

load_model/load_tokenizer/LoadedModel import torch, so they are loaded lazily: `specquant models list`
should not pay seconds of torch import to print a table.
"""

from .cache import cache_info, is_cached, list_models, verify, write_entry
from .fetch import fetch
from .registry import (
    DEFAULT_MODEL,
    REGISTRY,
    ModelSpec,
    ResolvedModel,
    get_spec,
    resolve,
)

__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "LoadedModel",
    "ModelSpec",
    "ResolvedModel",
    "cache_info",
    "fetch",
    "get_spec",
    "is_cached",
    "list_models",
    "load_model",
    "load_tokenizer",
    "resolve",
    "verify",
    "write_entry",
]

_LAZY = {"load_model", "load_tokenizer", "LoadedModel"}


def __getattr__(name: str):
    if name in _LAZY:
        from . import load

        return getattr(load, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
