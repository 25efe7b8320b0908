"""Export a model to GGUF, llama.cpp's format, so llama.cpp runs the weights specquant runs (`specquant export
format=gguf`; docs/formats.md, "GGUF").

What maps exactly (the GGUF block is 32 weights along a row, with fp16 constants):

* Q4_0 is ``d * (q - 8)``: a symmetric grid of <= 4 bits (``(q - zero) * scale``, zero ``2**(bits-1)``) whose
  groups are whole multiples of 32 columns (group 32, 64, 128, per-channel) is written as is, ``q + 8 - zero`` per
  code and ``d = fp16(scale)`` per block (a 64-group's scale repeated in both of its blocks).
* Q4_1 is ``d * q + m``: an asymmetric grid of <= 4 bits with integer zero ``z`` is written as ``d = fp16(scale)``,
  ``m = fp16(-scale * z)``, codes unchanged.
* Q8_0 is ``d * q`` with int8 ``q``: a symmetric 8-bit grid (zero 128) is ``q - 128`` with ``d = fp16(scale)``.

The only change is fp16 rounding of ``d`` (and ``m``): relative 2**-11 of the scale, so a weight moves by at most
``scale * 2**-11 * (|q - zero|)`` (Q4_0, Q8_0) or ``scale * 2**-11 * (q + z)`` (Q4_1), and a scale below fp16's
normal range (6.1e-5) loses more. Everything else -- a group that does not cover whole 32-column blocks (group 16,
an act-order ``g_idx`` that mixes groups inside a block, a row length not a multiple of 32), an asymmetric 8-bit
grid, 5-7 bits, or a ``type=`` that is not the grid's own -- is dequantized and quantized again by llama.cpp's
reference rounding (gguf-py's port of it) to the nearest type, and recorded as not exact, per tensor, in the
result and in the file's metadata (``specquant.*`` keys, which llama.cpp ignores).

The model's metadata and tokenizer are copied from the GGUF the registry model was converted from (its cache entry
keeps it); only tensor data and types are replaced. Without one (a model made from a config), llama and qwen2
metadata are written from ``config.json`` and the tokenizer from ``tokenizer.json`` (byte-level BPE). Tensor names
come from gguf-py's name map; llama's q/k rows are permuted as llama.cpp's converter does (its RoPE pairs adjacent
rows, transformers' pairs halves), gemma's norms are stored as ``1 + w``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from toolkit.errors import InputError, ModelError
from toolkit.models import load_model
from toolkit.models.cache import SOURCE_GGUF
from toolkit.paths import models_dir
from toolkit.quant.checkpoint import (
    is_quantized_checkpoint,
    load_quantized,
    read_manifest,
)
from toolkit.quant.formats.common import ExportError
from toolkit.quant.formats.convert import is_foreign_quantized

TYPES = ("auto", "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")
BLOCK = 32
SAME = "same weights"
REQUANTIZED = "nearest type, requantized"
EXPORT_VERSION = 1  # part of the bench's cache key: bump when the bytes written for the same input change
_ARCHES = {"gemma3_text": "gemma3", "qwen2_moe": "qwen2moe"}


@dataclass
class GGUFExport:
    """What `export_gguf` wrote: per-tensor types and whether each holds exactly the grid specquant runs."""

    path: Path
    source: str
    tensors: dict[str, dict] = field(default_factory=dict)  # gguf name -> {"type", "exact", "max_abs_diff"}

    @property
    def requantized(self) -> list[str]:
        return [n for n, t in self.tensors.items() if not t["exact"]]

    @property
    def exact(self) -> bool:
        return not self.requantized

    @property
    def weights(self) -> str:
        """``same weights`` (every quantized tensor on its own grid, up to fp16 constants; float tensors in their
        requested float type) or ``nearest type, requantized``."""
        return SAME if self.exact else REQUANTIZED

    @property
    def main_type(self) -> str:
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            if t["type"] != "F32" or t.get("dims", 2) > 1:
                counts[t["type"]] = counts.get(t["type"], 0) + t["numel"]
        return max(counts, key=counts.get) if counts else "F32"

    def max_abs_diff(self) -> dict[str, float]:
        """Largest |GGUF value - specquant value| per GGUF type, over the tensors mapped exactly."""
        out: dict[str, float] = {}
        for t in self.tensors.values():
            if t["exact"]:
                out[t["type"]] = max(out.get(t["type"], 0.0), t["max_abs_diff"])
        return out

    def to_dict(self) -> dict:
        return {"path": str(self.path), "source": self.source, "type": self.main_type, "weights": self.weights,
                "exact": self.exact, "requantized": self.requantized, "max_abs_diff": self.max_abs_diff()}


# ------------------------------------------------------------------------------------------- sources


def template_gguf(model: str | Path) -> Path | None:
    """The GGUF a registry model (by name, or its cache directory) was converted from, or None."""

    text = str(model)
    candidates = [Path(text).expanduser() / SOURCE_GGUF]
    if "/" not in text and not Path(text).expanduser().exists():
        candidates.append(models_dir() / text / SOURCE_GGUF)
    return next((c for c in candidates if c.is_file()), None)


def _load(model: str | Path):
    """``(float model, qsd or None, tokenizer, template GGUF or None, source label)``."""

    path = Path(str(model)).expanduser()
    if is_quantized_checkpoint(path):
        float_model, qsd, tokenizer = load_quantized(path, dtype=torch.float32)
        source = read_manifest(path).get("source")
        template = template_gguf(source) if source else None
        return float_model, qsd, tokenizer, template, str(path.absolute())

    if is_foreign_quantized(path):
        raise InputError(f"{model} is a GPTQ/AWQ directory", "export the specquant checkpoint it came from, or "
                                                              "its float model")

    loaded = load_model(str(model), dtype=torch.float32)
    return loaded.model, None, loaded.tokenizer, template_gguf(model), str(model)


# ----------------------------------------------------------------------------------------- encoding


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1, BLOCK)


def _half(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``[out, nb, 32]`` codes 0..15 -> ``[out, nb, 16]`` bytes: byte j = q[j] | q[j + 16] << 4 (ggml's order)."""
    q = q.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _rows(*parts: torch.Tensor) -> np.ndarray:
    """Concatenate per-block byte fields ``[out, nb, k]`` into rows of blocks ``[out, nb * block_bytes]``."""
    raw = torch.cat([p.contiguous().view(torch.uint8).reshape(*p.shape[:2], -1) for p in parts], dim=-1)
    return raw.reshape(raw.shape[0], -1).numpy()


def _block_groups(qw) -> torch.Tensor | None:
    """The group of each 32-column block ``[in / 32]``, or None when a block spans two groups."""
    if qw.in_features % BLOCK:
        return None
    groups = qw.group_index().reshape(-1, BLOCK)
    if not bool((groups == groups[:, :1]).all()):
        return None
    return groups[:, 0]


def exact_blocks(qw, gtype: str) -> tuple[np.ndarray, torch.Tensor] | None:
    """``(GGUF bytes [out, row bytes], the float values those bytes stand for [out, in])`` writing ``qw``'s grid
    as ``gtype`` blocks unchanged, or None when it does not fit (see the module doc)."""
    bg = _block_groups(qw)
    if bg is None or not torch.isfinite(qw.scale).all() or float(qw.scale.abs().max()) > 65504:
        return None
    codes = _blocks(qw.codes.to(torch.int32))
    scale = qw.scale[:, bg].to(torch.float32)  # [out, nb]
    zero = qw.zero[:, bg].to(torch.int32)
    d = _half(scale)
    if gtype == "Q4_0":
        q = codes - zero[..., None] + 8
        if int(q.min()) < 0 or int(q.max()) > 15:
            return None
        value = d.float()[..., None] * (q - 8).float()
        return _rows(d[..., None], _pack_nibbles(q)), value.reshape(qw.out_features, -1)
    if gtype == "Q4_1":
        if int(codes.max()) > 15:
            return None
        m = _half(-scale * zero.float())
        value = d.float()[..., None] * codes.float() + m.float()[..., None]
        return _rows(d[..., None], m[..., None], _pack_nibbles(codes)), value.reshape(qw.out_features, -1)
    if gtype == "Q8_0":
        q = codes - zero[..., None]
        if int(q.min()) < -128 or int(q.max()) > 127:
            return None
        value = d.float()[..., None] * q.float()
        return _rows(d[..., None], q.to(torch.int8)), value.reshape(qw.out_features, -1)
    return None


def own_type(qw) -> str:
    """The GGUF type of ``qw``'s grid: Q4_0 (symmetric <= 4 bits), Q4_1 (asymmetric <= 4 bits), Q8_0 (else)."""
    if qw.config.bits <= 4:
        return "Q4_0" if qw.config.symmetric else "Q4_1"
    return "Q8_0"


def _float_encode(w: np.ndarray, gtype: str) -> tuple[np.ndarray, str]:
    """``w`` (float32) in ``gtype`` by gguf-py's port of llama.cpp's reference quantizers (F16 where a quantized
    type's 32-blocks do not fit the row)."""
    import gguf

    if gtype in ("Q8_0", "Q4_0", "Q4_1") and (w.ndim < 2 or w.shape[-1] % BLOCK):
        gtype = "F16"
    if gtype == "F32":
        return np.ascontiguousarray(w, dtype=np.float32), gtype
    if gtype == "F16":
        return w.astype(np.float16), gtype
    if gtype == "BF16" and w.shape[-1] % 2:
        return w.astype(np.float16), "F16"
    return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), _qtype(gtype)), gtype


def _qtype(gtype: str):
    import gguf

    return getattr(gguf.GGMLQuantizationType, gtype)


def _dequant(data: np.ndarray, gtype: str) -> np.ndarray:
    import gguf

    if gtype in ("F32", "F16"):
        return data.astype(np.float32)
    return gguf.quants.dequantize(data, _qtype(gtype)).astype(np.float32)


# ------------------------------------------------------------------------------------------- layout


def _arch(config) -> str:
    import gguf

    arch = _ARCHES.get(config.model_type, config.model_type)
    if arch not in gguf.MODEL_ARCH_NAMES.values():
        raise ExportError(f"gguf-py has no architecture {config.model_type!r}", "export a llama/qwen2/gemma3 model")
    return arch


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order (`convert_hf_to_gguf.LlamaModel.permute`), on dim 0 of any tensor."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _row_transform(arch: str, gguf_name: str, config):
    """The row permutation llama.cpp's converter applies to this tensor (identity for most)."""
    if arch != "llama":
        return lambda t: t
    if ".attn_q." in gguf_name:
        return lambda t: _permute(t, config.num_attention_heads)
    if ".attn_k." in gguf_name:
        return lambda t: _permute(t, config.num_key_value_heads or config.num_attention_heads)
    return lambda t: t


def _gguf_names(model, arch: str) -> dict[str, str]:
    """HF state-dict name -> GGUF tensor name, tied duplicates dropped (llama.cpp re-ties a missing output)."""
    import gguf

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    out: dict[str, str] = {}
    for key in model.state_dict(keep_vars=True):
        if key.endswith("rotary_emb.inv_freq"):
            continue
        gname = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise ExportError(f"no GGUF name for {key}", "this architecture's layout is not supported")
        out[key] = gname
    if getattr(model.config, "tie_word_embeddings", False):
        out = {k: v for k, v in out.items() if v != "output.weight"}
    return out


# ------------------------------------------------------------------------------------------ metadata


def _copy_fields(writer, reader, skip: set[str]) -> None:
    import gguf

    for key, fld in reader.fields.items():
        if key.startswith("GGUF.") or key in skip:
            continue
        vtype = fld.types[0]
        sub = fld.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, fld.contents(), vtype, sub)


def _fields_from_config(writer, config, tokenizer) -> None:
    """llama/qwen2 hyperparameters and a byte-level BPE tokenizer, for a model without a registry GGUF."""
    if writer.arch not in ("llama", "qwen2"):
        raise ExportError(f"{config.model_type}: no registry GGUF to copy the metadata from, and specquant writes "
                          f"it from config.json for llama and qwen2 only", "export a registry model")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name(str(getattr(config, "_name_or_path", "") or "specquant-export"))
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None)
                                    or (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if tokenizer is None:
        raise ExportError("the model has no tokenizer to write into the GGUF", "export a model with tokenizer.json")
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    if spec["model"]["type"] != "BPE":
        raise ExportError(f"tokenizer model {spec['model']['type']} is not byte-level BPE",
                          "export a registry model (its GGUF carries the tokenizer)")
    vocab = dict(spec["model"]["vocab"])
    special = set()
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["id"])
    size = max(config.vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [5] * size  # unused
    for text, i in vocab.items():
        tokens[i], types[i] = text, 3 if i in special else 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for kind in ("bos", "eos", "unk", "pad"):
        token_id = getattr(tokenizer, f"{kind}_token_id", None)
        if token_id is not None:
            getattr(writer, f"add_{kind}_token_id")(int(token_id))
    writer.add_add_bos_token(False)


_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}


# -------------------------------------------------------------------------------------------- export


def export_gguf(model: str | Path, out: str | Path, gguf_type: str = "auto", force: bool = False) -> GGUFExport:
    """Write ``model`` (registry name, float model directory or specquant checkpoint) as one GGUF file ``out``.

    ``gguf_type``: ``auto`` keeps a checkpoint's grid (Q4_0 / Q4_1 / Q8_0, see the module doc) and writes a float
    model as F16; ``f32``/``f16``/``bf16``/``q8_0``/``q4_0``/``q4_1`` name the type of the quantized layers (of a
    checkpoint) or of every matrix (of a float model). Norms and other vectors are F32; a checkpoint's float
    matrices (embeddings) F16. Written aside and renamed, so a file at ``out`` is always whole."""

    if gguf_type not in TYPES:
        raise InputError(f"unknown type={gguf_type}", f"use type={' | '.join(TYPES)}")
    out = Path(out).expanduser().absolute()
    if out.exists() and not force:
        raise ModelError(f"{out} already exists", "pass force=true to replace it, or choose another out=")
    float_model, qsd, tokenizer, template, source = _load(model)
    config = float_model.config
    arch = _arch(config)
    names = _gguf_names(float_model, arch)
    quantized = dict(qsd.weights) if qsd is not None else {}
    state = float_model.state_dict()
    result = GGUFExport(path=out, source=source)
    tensors: list[tuple[str, np.ndarray, str]] = []
    requested = None if gguf_type == "auto" else gguf_type.upper()
    for key, gname in names.items():
        transform = _row_transform(arch, gname, config)
        layer = key.removesuffix(".weight")
        if key.endswith(".weight") and layer in quantized:
            qw = quantized[layer]
            target = requested or own_type(qw)
            reference = transform(qw.dequantize(torch.float32))
            mapped = exact_blocks(_transformed(qw, transform), target)
            if mapped is not None:
                data, value = mapped
                tensors.append((gname, data, target))
                result.tensors[gname] = {"type": target, "exact": True, "dims": 2, "numel": value.numel(),
                                         "max_abs_diff": float((value - reference).abs().max())}
                continue
            w = reference.numpy()
            data, gtype = _float_encode(w, target)
            tensors.append((gname, data, gtype))
            result.tensors[gname] = {"type": gtype, "exact": False, "dims": 2, "numel": w.size,
                                     "max_abs_diff": float(np.abs(_dequant(data, gtype).reshape(w.shape) - w).max())}
            continue
        w = transform(state[key].detach().to(torch.float32))
        if arch in ("gemma2", "gemma3") and key.endswith("norm.weight"):
            w = w + 1  # gemma's norms scale by (1 + w); llama.cpp's converter stores 1 + w
        w = w.numpy()
        if w.ndim < 2:
            gtype = "F32"
        elif quantized:
            gtype = "F16"  # a checkpoint's own float matrices (embeddings, skipped layers)
        else:
            gtype = requested or "F16"
        data, gtype = _float_encode(w, gtype)
        diff = float(np.abs(_dequant(data, gtype).reshape(w.shape) - w).max())
        tensors.append((gname, data, gtype))
        result.tensors[gname] = {"type": gtype, "exact": True, "max_abs_diff": diff, "dims": w.ndim,
                                 "numel": w.size}
    if template is not None:
        tensors = _in_template_order(tensors, template)
    _write(out, arch, tensors, result, template, config, tokenizer, force)
    return result


def _transformed(qw, transform):
    """``qw`` with its rows reordered by ``transform`` (codes, scales and zero points alike)."""
    from dataclasses import replace

    return replace(qw, codes=transform(qw.codes), scale=transform(qw.scale), zero=transform(qw.zero))


def _in_template_order(tensors: list, template: Path) -> list:
    import gguf

    order = {t.name: i for i, t in enumerate(gguf.GGUFReader(template).tensors)}
    return sorted(tensors, key=lambda t: order.get(t[0], len(order)))


def _write(out: Path, arch: str, tensors: list, result: GGUFExport, template: Path | None, config, tokenizer,
           force: bool) -> None:
    import gguf

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.part")
    writer = gguf.GGUFWriter(partial, arch)
    try:
        if template is not None:
            reader = gguf.GGUFReader(template)
            _copy_fields(writer, reader, skip={"general.architecture", "general.file_type"})
            del reader
        else:
            _fields_from_config(writer, config, tokenizer)
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_file_type(_FILE_TYPES.get(result.main_type, 1))
        writer.add_string("specquant.source", result.source)
        writer.add_string("specquant.weights", result.weights)
        writer.add_bool("specquant.exact", result.exact)
        if result.requantized:
            writer.add_array("specquant.requantized", result.requantized)
        for name, data, gtype in tensors:
            raw = None if gtype in ("F32", "F16") else _qtype(gtype)
            writer.add_tensor(name, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, out)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
