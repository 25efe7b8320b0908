"""Load a model (registry name, local checkpoint directory, or hub id when online) ready for inference."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelError
from .cache import MANIFEST, is_cached, verify
from .fetch import fetch
from .registry import ModelSpec, ResolvedModel, resolve


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel, in eval mode
    tokenizer: Any  # pad token set, padding_side="left" (batched generation appends on the right)
    name: str
    spec: ModelSpec | None  # None for local directories and hub ids
    path: Path | None  # checkpoint directory (None for hub ids)
    dtype: torch.dtype
    load_seconds: float  # verify + weights + tokenizer; excludes a first-use fetch and module imports


def load_model(
    name_or_path: str | Path, dtype: torch.dtype | str = torch.float32, fetch_if_missing: bool = True
) -> LoadedModel:
    resolved = resolve(name_or_path)
    dtype = _as_dtype(dtype)
    source = _prepare(resolved, fetch_if_missing)
    try:
        start = time.perf_counter()
        _verify_if_managed(resolved)  # first, so a damaged file is reported as damage, not as a parse error
        verify_seconds = time.perf_counter() - start
        # Import the architecture's modules off the clock: in a fresh process transformers spends ~2.5 s
        # importing modeling code (torch.distributed, dynamo), which is not loading work.
        config, model_class = _architecture(source)
        start = time.perf_counter()
        model = model_class.from_pretrained(source, config=config, dtype=dtype)
        tokenizer = _tokenizer(source)
        load_seconds = verify_seconds + time.perf_counter() - start
    except (OSError, ValueError, KeyError) as exc:
        raise _load_error(resolved, exc) from exc
    model.eval()
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id  # silences generate()'s per-call warning
    return LoadedModel(model, tokenizer, resolved.name, resolved.spec, resolved.path, dtype, load_seconds)


def load_tokenizer(name_or_path: str | Path, fetch_if_missing: bool = True) -> Any:
    """Just the tokenizer (no weights, no checksum pass): cheap enough for data preparation."""
    resolved = resolve(name_or_path)
    source = _prepare(resolved, fetch_if_missing)
    try:
        return _tokenizer(source)
    except (OSError, ValueError, KeyError) as exc:
        raise _load_error(resolved, exc) from exc


def _prepare(resolved: ResolvedModel, fetch_if_missing: bool) -> str:
    """What to hand to from_pretrained; fetches a registry model on first use."""
    if resolved.kind == "hub":
        return resolved.hub_id
    if resolved.kind == "registry" and not is_cached(resolved.name):
        if not fetch_if_missing:
            raise ModelError(f"model {resolved.name} is not fetched yet", f"specquant models fetch {resolved.name}")
        size = resolved.spec.approx_fp32_bytes / 1e9
        print(
            f"fetching model {resolved.name} on first use (~{size:.1f} GB in the cache) ...",
            file=sys.stderr,
            flush=True,
        )
        fetch(resolved.name)
    return str(resolved.path)


def _verify_if_managed(resolved: ResolvedModel) -> None:
    """Cache entries (and any directory written by write_entry) carry a manifest; check it so a truncated
    file fails clearly here instead of as a cryptic safetensors error, or worse, as silently wrong weights."""
    if resolved.kind == "registry" or (resolved.path and (resolved.path / MANIFEST).is_file()):
        verify(resolved.path)


def _architecture(source: str) -> tuple[Any, type]:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(source)
    try:
        return config, MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ModelError(
            f"{source} is a {config.model_type!r} model, which transformers cannot load as a causal LM",
            "use a decoder-only text model (see `specquant models list`)",
        ) from None


def _tokenizer(source: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ModelError(f"unknown dtype {dtype!r}", "use float32, bfloat16 or float16")
    return value


def _load_error(resolved: ResolvedModel, exc: Exception) -> ModelError:
    if resolved.kind == "registry":
        fix = f"specquant models fetch {resolved.name} force=true"
    elif resolved.kind == "hub":
        fix = "check the hub id and your network, or use a registry model (`specquant models list`)"
    else:
        fix = "check that the directory holds a complete save_pretrained checkpoint with its tokenizer"
    return ModelError(f"cannot load model {resolved.name}: {type(exc).__name__}: {exc}", fix)
