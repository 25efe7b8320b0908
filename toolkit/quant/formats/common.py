"""What the GPTQ and AWQ format modules share: detecting a format, writing an export directory atomically with
checksums, and rebuilding the float model around imported quantized layers.

An export directory is what transformers expects of a pre-quantized model (``config.json`` with a
``quantization_config``, ``model.safetensors``, tokenizer files) plus ``specquant_export.json``: the source
checkpoint, its recipe, and size + xxh3 of every file, written last. Other tools ignore that file; our import
checks it when present, so a damaged export of ours is an error rather than wrong logits. A foreign checkpoint
(gptqmodel, AutoAWQ) has no such record: it is checked for structure (tensors present, shapes, code ranges).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from toolkit.errors import ModelError
from toolkit.fileio import checksum_files, file_problem, write_json_atomic
from toolkit.models.atomic_dir import remove_abandoned_temps, write_dir_atomic
from toolkit.quant.checkpoint import tokenizer_in as load_tokenizer
from toolkit.quant.model_quant import QuantizedStateDict

EXPORT_MANIFEST = "specquant_export.json"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
EXPORT_FORMAT_VERSION = 1


class ExportError(ModelError):
    """A checkpoint that the requested format cannot hold (bits, groups, zero points, layer selection)."""


def ragged_message(name: str, qw, fmt: str) -> str:
    """Why a layer with a ragged last group (group size not dividing in_features) is not exported."""
    gs = qw.config.group_size
    return (f"{name}: in_features={qw.in_features} is not a multiple of group_size={gs}: its last group holds "
            f"{qw.in_features % gs} columns, which specquant runs (zero-padded) but the {fmt} kernels of "
            f"transformers, vLLM and gptqmodel expect whole groups")


def ragged_fix(qw) -> str:
    fits = [g for g in (128, 64, 32) if g < qw.config.group_size and qw.in_features % g == 0]
    return (f"quantize with group_size={fits[0]} for export" if fits else
            "quantize with group_size=-1 for export") + " (this checkpoint still loads in specquant as it is)"


# ------------------------------------------------------------------------------------------ detection


def read_quantization_config(path: str | Path) -> dict | None:
    """``quantization_config`` of ``path/config.json`` (a dict), or None when there is none or no readable file."""
    try:
        config = json.loads((Path(path).expanduser() / CONFIG).read_text())
    except (OSError, ValueError):
        return None
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    return qc if isinstance(qc, dict) else None


def detect_format(path: str | Path) -> str | None:
    """``"gptq"`` or ``"awq"`` when ``path`` is a directory whose config.json says it holds that format, else None."""
    qc = read_quantization_config(path)
    method = str((qc or {}).get("quant_method", "")).lower()
    return method if method in ("gptq", "awq") else None


def export_source(path: str | Path) -> str | None:
    """The float model an export of ours was quantized from (registry name, path or hub id), or None if unknown."""
    try:
        record = json.loads((Path(path).expanduser() / EXPORT_MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return record.get("source") if isinstance(record, dict) else None


# -------------------------------------------------------------------------------------------- export


def float_tensors(model: nn.Module, quantized: set[str]) -> dict[str, torch.Tensor]:
    """The model's state dict without the quantized layers' weights, tied tensors once (first name kept, as
    transformers re-ties the rest on load), on the CPU and contiguous, as safetensors wants them."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    drop = {f"{name}.weight" for name in quantized} | {f"{name}.bias" for name in quantized}
    for key, tensor in model.state_dict().items():
        if key in drop:
            continue
        tensor = tensor.detach()
        if tensor.device.type == "meta":
            raise ModelError(f"{key} was never loaded (meta device)", "export from a checkpoint loaded whole")
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if tensor.numel() and ident in seen:
            continue
        seen.add(ident)
        out[key] = tensor.cpu().contiguous().clone()
    return out


def write_export(out: Path, *, tensors: dict[str, torch.Tensor], model: nn.Module, quantization_config: dict,
                 extra_json: dict[str, dict], tokenizer: Any, record: dict, force: bool) -> Path:
    """Build the export directory in a temp sibling and rename it into place (nothing half-written is ever seen).

    ``extra_json`` holds other JSON files by name (``quantize_config.json``); ``record`` goes into
    `EXPORT_MANIFEST` together with the size and xxh3 of every other file, which is written last.
    """
    from safetensors.torch import save_file

    out = Path(out).expanduser().absolute()
    if out.exists() and not force:
        raise ModelError(f"{out} already exists", "pass force=true to replace it, or choose another out=")
    config = model.config
    generation_config = getattr(model, "generation_config", None)

    def build(tmp: Path) -> None:
        config.save_pretrained(tmp)
        # patched afterwards rather than set on the config object: transformers would try to parse it
        config_json = json.loads((tmp / CONFIG).read_text())
        config_json["architectures"] = [type(model).__name__]
        config_json["quantization_config"] = quantization_config
        write_json_atomic(tmp / CONFIG, config_json)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, data in extra_json.items():
            write_json_atomic(tmp / name, data)
        save_file(tensors, tmp / WEIGHTS, metadata={"format": "pt"})  # "pt": what transformers checks for
        write_json_atomic(tmp / EXPORT_MANIFEST, {**record, "format_version": EXPORT_FORMAT_VERSION,
                                                  "files": checksum_files(tmp, exclude={EXPORT_MANIFEST})})

    remove_abandoned_temps(out.parent, out.name)
    write_dir_atomic(out, build)
    return out


def block_layout(model: nn.Module, quantized: set[str]) -> tuple[str, list[str]]:
    """``(block prefix, layer suffixes)`` such that the quantized layers are exactly the ``nn.Linear`` layers
    ``<prefix>.<i>.<suffix>``: how transformers' loaders pick the layers to replace (by suffix, in every block).

    Raises ExportError when no such description exists (a layer quantized in some blocks only, or outside the
    repeated blocks), since a loader would then build the wrong modules."""
    pattern = re.compile(r"^(.*?)\.(\d+)\.(.+)$")
    prefixes, suffixes = set(), set()
    for name in quantized:
        match = pattern.match(name)
        if match is None:
            raise ExportError(f"quantized layer {name} is not inside a numbered block (like model.layers.3)",
                              "re-quantize with that layer in recipe.skip")
        prefixes.add(match.group(1))
        suffixes.add(match.group(3))
    if len(prefixes) != 1:
        raise ExportError(f"quantized layers sit under several block lists {sorted(prefixes)}",
                          "re-quantize one block list only (recipe.modules)")
    prefix = prefixes.pop()
    selected = set()
    for name, module in model.named_modules():
        match = pattern.match(name)
        if type(module) is nn.Linear and match and match.group(1) == prefix and match.group(3) in suffixes:
            selected.add(name)
    if selected != quantized:
        odd = sorted(selected ^ quantized)[:4]
        raise ExportError(f"the quantized layers differ from block to block (e.g. {odd}); GPTQ/AWQ loaders choose "
                          f"layers by name in every block alike",
                          "re-quantize with a skip list that names layer types (mlp.down_proj), not single blocks")
    return prefix, sorted(suffixes)


# -------------------------------------------------------------------------------------------- import


def verify_export(path: Path) -> dict | None:
    """Check every file our export record lists (size + xxh3); returns the record, or None for foreign dirs."""
    manifest = path / EXPORT_MANIFEST
    if not manifest.is_file():
        return None
    try:
        record = json.loads(manifest.read_text())
        files = record["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"{manifest} is unreadable ({exc})", _re_export_fix(path, None)) from exc
    for rel, entry in files.items():
        problem = file_problem(path / rel, entry)
        if problem:
            raise ModelError(f"exported checkpoint {path} is damaged: file {rel} {problem}",
                             _re_export_fix(path, record))
    return record


def _re_export_fix(path: Path, record: dict | None) -> str:
    src = (record or {}).get("checkpoint") or "<the specquant checkpoint>"
    fmt = (record or {}).get("format") or "gptq|awq"
    return f"re-run specquant export model={src} format={fmt} out={path} force=true"


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors file(s): ``model.safetensors``, or the shards its index lists."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if (path / WEIGHTS_INDEX).is_file():
        index = json.loads((path / WEIGHTS_INDEX).read_text())
        files = sorted(set(index.get("weight_map", {}).values()))
    elif (path / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{path} holds no .safetensors weights", "point model= at a complete GPTQ/AWQ directory")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            tensors.update(load_file(path / name))
        except (OSError, SafetensorError) as exc:
            raise ModelError(f"cannot read {path / name}: {exc}", "re-download or re-export the checkpoint") from exc
    return tensors


def build_float_model(path: Path, dtype: torch.dtype | None) -> nn.Module:
    """The architecture ``config.json`` describes, without its quantization_config, weights uninitialised."""
    import transformers
    from transformers import AutoConfig, GenerationConfig
    from transformers.initialization import no_init_weights
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # otherwise transformers would look for gptqmodel
    architectures = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    if model_class is None:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with no_init_weights():  # every weight is loaded next
        model = model_class._from_config(config, dtype=dtype or torch.float32)
    model.tie_weights()
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def assemble(path: Path, tensors: dict[str, torch.Tensor], qsd: QuantizedStateDict, dtype: torch.dtype | None,
             quant_keys: set[str]) -> tuple[nn.Module, Any]:
    """``(model, tokenizer)``: the float model with every non-quantized tensor loaded (in ``dtype``, by default
    the saved float dtype) and the quantized layers' weights left on the meta device, for `swap_quantized_modules`.
    Raises ModelError, loading nothing, when the tensors do not fit the architecture."""
    float_state = {k: v for k, v in tensors.items() if k not in quant_keys}
    if dtype is None:
        dtype = next((v.dtype for v in float_state.values() if v.is_floating_point()), torch.float32)
    try:
        model = build_float_model(path, dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot rebuild the model of {path}: {exc}", "check its config.json") from exc
    for name in qsd.weights:
        linear = model.get_submodule(name) if _has_module(model, name) else None
        if not isinstance(linear, nn.Linear):
            raise ModelError(f"{path}: quantized layer {name} is not a Linear layer of the model config.json "
                             f"describes", "check that config.json belongs to these weights")
    result = model.load_state_dict(float_state, strict=False)
    expected = {f"{name}.weight" for name in qsd.weights} | {
        f"{name}.bias" for name, qw in qsd.weights.items() if qw.bias is not None}
    state = model.state_dict(keep_vars=True)
    loaded = {state[k].data_ptr() for k in float_state if k in state}
    # a tied tensor (lm_head.weight = embed_tokens.weight) is saved once and filled through its twin
    missing = [k for k in result.missing_keys if k not in expected and state[k].data_ptr() not in loaded]
    if result.unexpected_keys or missing:
        raise ModelError(f"{path}: the weights do not fit the model config.json describes: missing {missing[:5]}, "
                         f"unexpected {sorted(result.unexpected_keys)[:5]}", "check the checkpoint is complete")
    for name in qsd.weights:
        linear = model.get_submodule(name)
        linear.weight = nn.Parameter(torch.empty_like(linear.weight, device="meta"), requires_grad=False)
    return model, load_tokenizer(path)


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def layer_names(tensors: dict[str, torch.Tensor], suffix: str) -> list[str]:
    """Module names that own a tensor ``<name>.<suffix>`` (``qweight``), in file order."""
    tail = "." + suffix
    return [k[: -len(tail)] for k in tensors if k.endswith(tail)]


def require(tensors: dict[str, torch.Tensor], key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``tensors[key]``, checked for dtype and shape (ValueError naming what differs)."""
    if key not in tensors:
        raise ValueError(f"tensor {key} is missing")
    t = tensors[key]
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise ValueError(f"tensor {key} is {t.dtype} {tuple(t.shape)}, expected {dtype} {tuple(shape)}")
    return t


def read_layers(path: Path, names: list[str], read: Callable[[str], Any]) -> dict:
    """``{name: read(name)}``, a ValueError/KeyError from ``read`` turned into one ModelError naming the layer."""
    out = {}
    for name in names:
        try:
            out[name] = read(name)
        except (ValueError, KeyError) as exc:
            raise ModelError(f"{path}: layer {name}: {exc}", "re-export or re-download the checkpoint") from exc
    return out
