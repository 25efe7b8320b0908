"""Quantized checkpoint directories: what `specquant quantize` writes and every command loads with ``model=DIR``.

Layout of a checkpoint directory (written atomically: built in a temp sibling, then renamed into place)::

    config.json              the model's transformers config (``architectures`` set), to rebuild the model
    generation_config.json   when the model has one
    tokenizer files          when a tokenizer was given (tokenizer.json, tokenizer_config.json, ...)
    quantized.safetensors    the tensors, below
    quant_manifest.json      format version, recipe, per-module records, skipped list, file sizes + xxh3_128;
                             written last, so its presence means the directory is complete

``quantized.safetensors`` holds, for each quantized Linear ``NAME``:

* ``NAME.codes``  uint8. ``codes`` layout ``int4_rows`` (bits <= 4 and an even ``in``): ``[out, in/2]``, two
  codes per byte along the input dimension, byte ``j`` of a row holding input ``2j`` in the low nibble and input
  ``2j+1`` in the high nibble (`toolkit.quant.primitives.pack_int4_rows`; 2- and 3-bit codes use the same
  nibbles). Layout ``uint8`` (8 bits, or an odd ``in``): ``[out, in]``, one code per byte.
* ``NAME.scale``  float32 ``[out, n_groups]``.
* ``NAME.zero``   uint8 ``[out, n_groups]`` (zero points are codes, so they fit; loaded back as int32).
* ``NAME.bias``   the bias, when the layer has one: the same key as the float model's state dict.
* ``NAME.g_idx``  int32 ``[in]``, only for act-order weights.

and every other tensor of the model's ``state_dict()`` under its usual name, in its dtype. Tensors that share
memory (tied embeddings) are saved once; the manifest's ``aliases`` maps each dropped name to the saved one.
Packed kernel layouts depend on the machine, so they are never saved: ``QuantLinear`` packs at load time.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

from toolkit import __version__
from toolkit.errors import ModelError
from toolkit.fileio import checksum_files, file_problem, write_json_atomic
from toolkit.models.atomic_dir import remove_abandoned_temps, write_dir_atomic
from toolkit.quant.model_quant import QuantizedStateDict, QuantRecipe, SkippedModule
from toolkit.quant.primitives import QuantConfig, pack_int4_rows, unpack_int4_rows
from toolkit.quant.quantized_weight import QuantizedWeight

MANIFEST = "quant_manifest.json"
PEER_RECORD = "peer.json"  # beside the manifest when another tool chose the codes (benchmarks.quant_peers)
TENSORS = "quantized.safetensors"
FORMAT = "specquant-quantized"
FORMAT_VERSION = 1
_QUANT_SUFFIXES = ("codes", "scale", "zero", "g_idx")


# ------------------------------------------------------------------------------------------------ save


def save_quantized(out_dir: str | Path, model: nn.Module, qsd: QuantizedStateDict, tokenizer: Any = None,
                   source: str | None = None, force: bool = False) -> Path:
    """Write ``model`` with ``qsd``'s Linear layers quantized as a checkpoint directory (layout: module doc).

    ``model`` is the float model ``qsd`` was made from (it is not modified); ``source`` names it in the manifest
    (registry name, path or hub id). An existing ``out_dir`` raises unless ``force``, which replaces it whole.
    """
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists() and not force:
        raise ModelError(f"{out_dir} already exists", "pass force=true to replace it, or choose another out=")
    tensors, modules, aliases = _checkpoint_tensors(model, qsd)
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    generation_config = getattr(model, "generation_config", None)

    def build(tmp: Path) -> None:
        from safetensors.torch import save_file

        config.save_pretrained(tmp)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        save_file(tensors, tmp / TENSORS, metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)})
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "source": source,
            "architecture": type(model).__name__,
            "dtype": str(_float_dtype(model)).removeprefix("torch."),
            "versions": _versions(),
            "recipe": qsd.recipe.to_dict(),
            "modules": modules,
            "skipped": [{"name": s.name, "reason": s.reason} for s in qsd.skipped],
            "aliases": aliases,
            "files": checksum_files(tmp, exclude={MANIFEST}),
        }
        write_json_atomic(tmp / MANIFEST, manifest)

    remove_abandoned_temps(out_dir.parent, out_dir.name)
    write_dir_atomic(out_dir, build)
    return out_dir


def _checkpoint_tensors(model: nn.Module, qsd: QuantizedStateDict) -> tuple[dict, dict, dict]:
    """(tensors to save, per-module manifest records, aliases {dropped name: saved name})."""
    state = model.state_dict()
    modules: dict[str, dict] = {}
    quantized: dict[str, torch.Tensor] = {}
    for name, qw in qsd.weights.items():
        weight = state.pop(f"{name}.weight", None)
        if weight is None:
            raise ValueError(f"the quantized state dict has {name!r}, which is not a layer of this model")
        if tuple(weight.shape) != (qw.out_features, qw.in_features):
            raise ValueError(f"{name}: model weight is {tuple(weight.shape)}, quantized weight is "
                             f"{(qw.out_features, qw.in_features)}; the state dict was made from another model")
        if (qw.bias is None) != (f"{name}.bias" not in state):
            raise ValueError(f"{name}: the layer {'has' if qw.bias is None else 'has no'} bias but the quantized "
                             f"weight {'has none' if qw.bias is None else 'has one'}")
        layout = "int4_rows" if qw.config.bits <= 4 and qw.in_features % 2 == 0 else "uint8"
        codes = qw.codes.detach().cpu().to(torch.uint8)
        quantized[f"{name}.codes"] = pack_int4_rows(codes) if layout == "int4_rows" else codes
        quantized[f"{name}.scale"] = qw.scale.detach().cpu().to(torch.float32)
        quantized[f"{name}.zero"] = qw.zero.detach().cpu().to(torch.uint8)  # zero points are codes: 0..255
        if qw.bias is not None:
            state[f"{name}.bias"] = qw.bias.detach()  # the quantized module's bias is the one saved
        if qw.g_idx is not None:
            quantized[f"{name}.g_idx"] = qw.g_idx.detach().cpu().to(torch.int32)
        modules[name] = {
            "bits": qw.config.bits,
            "group_size": qw.config.group_size,
            "symmetric": qw.config.symmetric,
            "shape": [qw.out_features, qw.in_features],
            "codes": layout,
            "bias": qw.bias is not None,
            "g_idx": qw.g_idx is not None,
            "rel_error": qsd.errors.get(name),
        }
    float_tensors, aliases = _dedup(state)
    clash = set(float_tensors) & set(quantized)
    if clash:
        raise ValueError(f"model state-dict names clash with quantized tensor names: {sorted(clash)[:5]}")
    return {**float_tensors, **{k: v.contiguous() for k, v in quantized.items()}}, modules, aliases


def _dedup(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors that are views of the same memory (tied weights) are saved once, under the first name."""
    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[tuple] = set()
    for name, tensor in state.items():
        tensor = tensor.detach()
        storage = (tensor.device.type, tensor.untyped_storage().data_ptr())
        key = (*storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if tensor.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        if tensor.numel():
            seen[key] = name
        # Distinct views of one storage: safetensors refuses shared memory, so copy the later ones.
        shared = tensor.numel() and storage in storages
        storages.add(storage)
        tensor = tensor.cpu().contiguous()
        out[name] = tensor.clone() if shared else tensor
    return out, aliases


def _float_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _versions() -> dict:

    out = {"specquant": __version__}
    for dist in ("transformers", "torch", "safetensors"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


# ------------------------------------------------------------------------------------------------ load


def is_quantized_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is a directory holding a specquant quantized-checkpoint manifest (not verified)."""
    try:
        manifest = json.loads((Path(path).expanduser() / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def peer_record(path: str | Path) -> dict | None:
    """What ``PEER_RECORD`` says of a checkpoint another tool quantized (`benchmarks.quant_peers`), else None."""
    try:
        record = json.loads((Path(path).expanduser() / PEER_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def read_manifest(path: str | Path) -> dict:
    path = Path(path).expanduser()
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise ModelError(f"{path} is not a complete quantized checkpoint: it has no {MANIFEST}",
                         _rebuild_fix(path, None)) from None
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: {MANIFEST} is unreadable ({exc})", _rebuild_fix(path, None)) from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ModelError(f"{path}/{MANIFEST} is not a {FORMAT} manifest", _rebuild_fix(path, None))
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ModelError(f"{path} was written in quantized-checkpoint format {version!r}; this specquant reads "
                         f"up to {FORMAT_VERSION}", f"upgrade specquant, or {_rebuild_fix(path, manifest)}")
    for key in ("files", "modules", "recipe"):
        if not isinstance(manifest.get(key), dict):
            raise ModelError(f"{path}/{MANIFEST} has no {key!r} table", _rebuild_fix(path, manifest))
    return manifest


def verify_quantized(path: str | Path, manifest: dict | None = None) -> dict:
    """Raise ModelError unless every file the manifest lists is present with its size and xxh3_128; returns it."""
    path = Path(path).expanduser()
    manifest = manifest or read_manifest(path)
    for required in ("config.json", TENSORS):
        if required not in manifest["files"]:
            raise ModelError(f"{path}/{MANIFEST} does not list {required}", _rebuild_fix(path, manifest))
    for rel, record in manifest["files"].items():
        problem = file_problem(path / rel, record)
        if problem:
            raise ModelError(f"quantized checkpoint {path} is damaged: file {rel} {problem}",
                             _rebuild_fix(path, manifest))
    return manifest


def load_quantized(path: str | Path, dtype: torch.dtype | None = None) -> tuple[nn.Module, QuantizedStateDict, Any]:
    """``(model, qsd, tokenizer)`` from a checkpoint directory, on the CPU, checksums verified first.

    ``model`` is the architecture rebuilt from ``config.json`` with every float tensor loaded (in ``dtype``, by
    default the dtype it was saved in) and eval mode; the quantized Linear layers' weights are left on the
    ``meta`` device (they hold nothing), so swap them (`swap_quantized_modules`) before running or moving it.
    ``tokenizer`` is None when the checkpoint has none.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    manifest = verify_quantized(path)
    fix = _rebuild_fix(path, manifest)
    try:
        tensors = load_file(path / TENSORS)
        model = _rebuild_model(path, manifest, dtype)
        tokenizer = tokenizer_in(path)
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        raise ModelError(f"cannot load quantized checkpoint {path}: {type(exc).__name__}: {exc}", fix) from exc

    modules: dict[str, dict] = manifest["modules"]
    quant_keys = {f"{name}.{s}" for name in modules for s in _QUANT_SUFFIXES}
    float_state = {k: v for k, v in tensors.items() if k not in quant_keys}
    for alias, saved in manifest.get("aliases", {}).items():
        if saved not in float_state:
            raise ModelError(f"{path}: alias {alias} points at {saved}, which {TENSORS} lacks", fix)
        float_state[alias] = float_state[saved]
    result = model.load_state_dict(float_state, strict=False)
    quantized_weights = {f"{name}.weight" for name in modules}
    missing = set(result.missing_keys) - quantized_weights
    absent = quantized_weights - set(result.missing_keys)  # a quantized layer the rebuilt model does not have
    if result.unexpected_keys or missing or absent:
        raise ModelError(
            f"quantized checkpoint {path} does not fit the model config.json describes: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(result.unexpected_keys)[:5]}, "
            f"quantized layers not in the model {sorted(absent)[:5]}", fix)

    weights = {}
    for name, record in modules.items():
        try:
            weights[name] = _quantized_weight(name, record, tensors)
        except (KeyError, ValueError) as exc:
            raise ModelError(f"quantized checkpoint {path}: module {name}: {exc}", fix) from exc
        _drop_weight(model, name)
    try:
        recipe = QuantRecipe.from_dict(manifest["recipe"])
    except (TypeError, ValueError) as exc:
        raise ModelError(f"quantized checkpoint {path}: bad recipe in {MANIFEST}: {exc}", fix) from exc
    qsd = QuantizedStateDict(
        weights=weights,
        recipe=recipe,
        skipped=[SkippedModule(s["name"], s["reason"]) for s in manifest.get("skipped", [])],
        errors={n: r["rel_error"] for n, r in modules.items() if r.get("rel_error") is not None},
    )
    return model, qsd, tokenizer


def _rebuild_model(path: Path, manifest: dict, dtype: torch.dtype | None) -> nn.Module:
    import transformers
    from transformers import AutoConfig, GenerationConfig
    from transformers.initialization import no_init_weights
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(path)
    model_class = getattr(transformers, manifest.get("architecture") or "", None)
    if model_class is None:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if dtype is None:
        dtype = getattr(torch, manifest.get("dtype") or "float32")
    with no_init_weights():  # every weight is loaded next; random init of a big model would take minutes
        model = model_class._from_config(config, dtype=dtype)
    model.tie_weights()  # no_init_weights also skips tying
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def _quantized_weight(name: str, record: dict, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
    config = QuantConfig(bits=record["bits"], group_size=record["group_size"], symmetric=record["symmetric"])
    out, in_features = record["shape"]
    codes = tensors[f"{name}.codes"]
    if record["codes"] == "int4_rows":
        codes = unpack_int4_rows(codes)
    elif record["codes"] != "uint8":
        raise ValueError(f"unknown codes layout {record['codes']!r}")
    n_groups = config.n_groups(in_features)
    scale, zero = tensors[f"{name}.scale"], tensors[f"{name}.zero"].to(torch.int32)
    if tuple(codes.shape) != (out, in_features) or codes.dtype != torch.uint8:
        raise ValueError(f"codes are {codes.dtype} {tuple(codes.shape)}, expected uint8 {(out, in_features)}")
    if tuple(scale.shape) != (out, n_groups) or tuple(zero.shape) != (out, n_groups):
        raise ValueError(f"scale/zero are {tuple(scale.shape)}/{tuple(zero.shape)}, expected {(out, n_groups)}")
    bias = tensors[f"{name}.bias"] if record["bias"] else None
    g_idx = tensors[f"{name}.g_idx"] if record["g_idx"] else None
    return QuantizedWeight(codes=codes, scale=scale.to(torch.float32), zero=zero, config=config, bias=bias,
                           g_idx=g_idx)


def _drop_weight(model: nn.Module, name: str) -> None:
    """Put a quantized layer's (never loaded) float weight on the meta device: no memory, and loud if used."""
    linear = model.get_submodule(name)
    linear.weight = nn.Parameter(torch.empty_like(linear.weight, device="meta"), requires_grad=False)


def tokenizer_in(path: Path) -> Any:
    """The tokenizer saved in checkpoint directory `path` (None if there is none), set up for left-padded batches."""
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # batched generation appends on the right
    return tokenizer


def _rebuild_fix(path: Path, manifest: dict | None) -> str:
    source = (manifest or {}).get("source") or "<the float model>"
    return f"re-run specquant quantize model={source} out={path} force=true to rebuild it"
