"""Export a specquant checkpoint to GPTQ v1 / AWQ GEMM, and import either back (entry points of the package)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from toolkit.errors import ModelError
from toolkit.quant.checkpoint import (
    is_quantized_checkpoint,
    load_quantized,
    read_manifest,
)
from toolkit.quant.formats import awq_gemm, gptq_v1
from toolkit.quant.formats.common import (
    ExportError,
    assemble,
    block_layout,
    detect_format,
    float_tensors,
    layer_names,
    load_tensors,
    read_layers,
    read_quantization_config,
    verify_export,
    write_export,
)
from toolkit.quant.model_quant import QuantizedStateDict, SkippedModule

FORMATS = ("gptq", "awq")
_MODULES = {"gptq": gptq_v1, "awq": awq_gemm}


def export_checkpoint(checkpoint: str | Path, fmt: str, out: str | Path, force: bool = False) -> Path:
    """Write the specquant checkpoint ``checkpoint`` (checksums verified first) as a ``fmt`` directory ``out``.

    Raises ExportError, writing nothing, when the checkpoint does not fit the format (see the package doc)."""

    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}", f"use format={' or format='.join(FORMATS)}")
    checkpoint = Path(checkpoint).expanduser()
    model, qsd, tokenizer = load_quantized(checkpoint)  # verifies every file's size and xxh3 before reading
    if not qsd.weights:
        raise ExportError(f"{checkpoint} has no quantized layers", "quantize the model first (specquant quantize)")
    module = _MODULES[fmt]
    module.check_exportable(qsd)
    quantized = set(qsd.weights)
    tensors = float_tensors(model, quantized)
    for name, qw in qsd.weights.items():
        tensors.update(module.layer_tensors(name, qw))
    if fmt == "gptq":
        prefix, suffixes = block_layout(model, quantized)
        hf, extra = gptq_v1.quantization_config(qsd, prefix, suffixes)
        extra_json = {gptq_v1.QUANTIZE_CONFIG: extra}
    else:
        block_layout(model, quantized)  # the same name-based selection applies to AWQ loaders
        floats = sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in quantized)
        hf, extra = awq_gemm.quantization_config(qsd, floats)
        extra_json = {awq_gemm.QUANT_CONFIG: extra}
    manifest = read_manifest(checkpoint)
    record = {"format": fmt, "checkpoint": str(checkpoint.absolute()), "source": manifest.get("source"),
              "recipe": qsd.recipe.to_dict(), "errors": qsd.errors,
              "skipped": [{"name": s.name, "reason": s.reason} for s in qsd.skipped]}
    return write_export(Path(out), tensors=tensors, model=model, quantization_config=hf, extra_json=extra_json,
                        tokenizer=tokenizer, record=record, force=force)


def is_foreign_quantized(path: str | Path) -> bool:
    """True when ``path`` is a directory in a format `import_checkpoint` reads (GPTQ or AWQ by config.json)."""
    return Path(path).expanduser().is_dir() and detect_format(path) is not None


def is_quantized_model(path: str | Path) -> bool:
    """True for a quantized checkpoint the engine loads: ours (`specquant quantize`) or a GPTQ/AWQ directory."""

    return is_quantized_checkpoint(path) or is_foreign_quantized(path)


def import_checkpoint(path: str | Path, dtype: torch.dtype | None = None) -> tuple[nn.Module, QuantizedStateDict, Any]:
    """``(model, qsd, tokenizer)`` from a GPTQ or AWQ directory, like `load_quantized` for our own checkpoints:
    the float tensors loaded (in ``dtype``, by default as saved), the quantized layers' weights on the meta device
    until `swap_quantized_modules` replaces them. Our exports' checksums are verified first."""
    path = Path(path).expanduser()
    fmt = detect_format(path)
    if fmt is None:
        raise ModelError(f"{path} is not a GPTQ or AWQ checkpoint (no quantization_config.quant_method gptq/awq "
                         f"in config.json)", "point model= at a GPTQ/AWQ directory or a specquant checkpoint")
    record = verify_export(path)
    qc = dict(read_quantization_config(path) or {})
    if fmt == "gptq":
        qc = {**_quantize_config_json(path), **qc}
        if str(qc.get("checkpoint_format", "gptq")).lower() not in ("gptq", "gptq_v2"):
            raise ExportError(f"{path}: GPTQ checkpoint_format {qc.get('checkpoint_format')!r}; specquant reads "
                              f"gptq (v1) and gptq_v2", "convert it to the gptq format with gptqmodel")
        if int(qc.get("bits", 0)) not in gptq_v1.BITS:
            raise ExportError(f"{path}: {qc.get('bits')}-bit GPTQ; specquant reads {gptq_v1.BITS} bits",
                              "use a checkpoint with 2/3/4/8 bits")
    else:
        awq_gemm.check_importable(qc)
    module = _MODULES[fmt]
    tensors = load_tensors(path)
    names = layer_names(tensors, "qweight")
    if not names:
        raise ModelError(f"{path} says {fmt} but holds no .qweight tensors", "re-export or re-download it")
    weights = read_layers(path, names, lambda name: module.read_layer(name, tensors, qc))
    qsd = QuantizedStateDict(weights=weights, recipe=module.import_recipe(qc, weights, record),
                             skipped=[SkippedModule(s["name"], s["reason"]) for s in (record or {}).get("skipped", [])],
                             errors=dict((record or {}).get("errors") or {}))
    quant_keys = {f"{n}.{s}" for n in names for s in gptq_v1.SUFFIXES}
    model, tokenizer = assemble(path, tensors, qsd, dtype, quant_keys)
    return model, qsd, tokenizer


def _quantize_config_json(path: Path) -> dict:
    try:
        data = json.loads((path / gptq_v1.QUANTIZE_CONFIG).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
