"""The GPTQ "v1" checkpoint format (auto-gptq's; what transformers + optimum + gptqmodel and vLLM load).

Per quantized Linear ``NAME`` (packing: `toolkit.quant.primitives.pack_gptq`):

* ``NAME.qweight`` int32 ``[in*bits/32, out]``: codes packed along the INPUT dim, LSB first (3 bits: a bit stream
  in which 2 of every 32 codes straddle words).
* ``NAME.qzeros``  int32 ``[n_groups, out*bits/32]``: ``zero - 1`` packed along the OUTPUT dim (the v1
  off-by-one; ``checkpoint_format: gptq_v2`` files store ``zero`` itself, and are read too).
* ``NAME.scales``  fp16 ``[n_groups, out]``.
* ``NAME.g_idx``   int32 ``[in]``: the group of each input channel (``i // group_size``; any order with act-order).
* ``NAME.bias``    fp16 ``[out]`` when the layer has one.

``config.json`` carries ``quantization_config`` (quant_method gptq, bits, group_size, desc_act, sym,
checkpoint_format gptq, and the block/layer selection optimum replaces), and ``quantize_config.json`` the same for
auto-gptq-era tools. What fits: 2/3/4/8 bits, any group size, symmetric or asymmetric, act-order; in/out features
multiples of 32/gcd(bits, 32) (8 at 4 bits, 32 at 3 bits). An asymmetric group whose zero point is 0 does not:
v1 would store -1, which AutoGPTQ/exllama/vLLM kernels read as 2**bits (gptqmodel alone masks it back).

Scales are stored in fp16 (the format's type): codes and zero points are kept exactly, each scale moves by at most
half an fp16 ulp (relative 2**-11), and the import restores exactly those fp16 values.
"""

from __future__ import annotations

import math

import torch

from toolkit.quant.formats.common import (
    ExportError,
    ragged_fix,
    ragged_message,
    require,
)
from toolkit.quant.model_quant import QuantizedStateDict, QuantRecipe
from toolkit.quant.primitives import QuantConfig, gptq_scales, pack_gptq, unpack_gptq
from toolkit.quant.quantized_weight import QuantizedWeight

SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "bias")
QUANTIZE_CONFIG = "quantize_config.json"
BITS = (2, 3, 4, 8)


def _trivial_g_idx(qw: QuantizedWeight) -> torch.Tensor:
    return (torch.arange(qw.in_features) // qw.config.resolve_group_size(qw.in_features)).to(torch.int32)


def check_exportable(qsd: QuantizedStateDict) -> None:
    """Raise ExportError naming the first layer the GPTQ v1 format cannot hold, and why."""
    for name, qw in qsd.weights.items():
        bits = qw.config.bits
        if bits not in BITS:
            raise ExportError(f"{name}: {bits}-bit codes; the GPTQ format holds {BITS} bits",
                              "re-quantize with bits in 2/3/4/8")
        step = 32 // math.gcd(bits, 32)
        for what, n in (("in_features", qw.in_features), ("out_features", qw.out_features)):
            if n % step:
                raise ExportError(f"{name}: {what}={n} is not a multiple of {step}, which GPTQ packing at {bits} bits "
                                  f"needs", "skip that layer when quantizing (recipe.skip)")
        if not qw.config.divides(qw.in_features):
            raise ExportError(ragged_message(name, qw, "GPTQ"), ragged_fix(qw))
        if not qw.config.symmetric and bool((qw.zero == 0).any()):
            count = int((qw.zero == 0).sum())
            raise ExportError(
                f"{name}: {count} group(s) have zero point 0, which the GPTQ v1 format (stores zero-1) cannot hold "
                f"for AutoGPTQ/exllama/vLLM kernels",
                "export format=awq (stores zero points as they are; 4-bit with groups), or re-quantize symmetric")
        if qw.config.symmetric and bool((qw.zero != 1 << (bits - 1)).any()):
            raise ExportError(f"{name}: marked symmetric but its zero points are not {1 << (bits - 1)}",
                              "re-quantize the checkpoint")
    configs = {(qw.config.bits, qw.config.group_size, qw.config.symmetric) for qw in qsd.weights.values()}
    if len(configs) != 1:
        raise ExportError(f"layers use different (bits, group_size, symmetric): {sorted(configs)}; the GPTQ format "
                          f"has one quantization_config per model", "re-quantize with one setting for every layer")


def layer_tensors(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The GPTQ tensors of one quantized layer, keyed ``NAME.qweight`` etc."""
    qweight, qzeros = pack_gptq(qw.codes.cpu(), qw.zero.cpu(), qw.config)
    g_idx = qw.g_idx.cpu().to(torch.int32) if qw.g_idx is not None else _trivial_g_idx(qw)
    out = {f"{name}.qweight": qweight, f"{name}.qzeros": qzeros, f"{name}.scales": gptq_scales(qw.scale.cpu()),
           f"{name}.g_idx": g_idx.contiguous()}
    if qw.bias is not None:
        out[f"{name}.bias"] = qw.bias.detach().cpu().to(torch.float16)
    return out


def quantization_config(qsd: QuantizedStateDict, block_prefix: str, suffixes: list[str]) -> tuple[dict, dict]:
    """``(config.json quantization_config, quantize_config.json)`` for a checkpoint `check_exportable` passed."""
    qw = next(iter(qsd.weights.values()))
    recipe = qsd.recipe
    desc_act = any(w.g_idx is not None and not torch.equal(w.g_idx.cpu().to(torch.int32), _trivial_g_idx(w))
                   for w in qsd.weights.values())
    common = {
        "bits": qw.config.bits,
        "group_size": qw.config.group_size,
        "desc_act": desc_act,
        "sym": qw.config.symmetric,
        "damp_percent": recipe.damp_percent,
        "static_groups": recipe.static_groups,
        "true_sequential": True,
        "checkpoint_format": "gptq",
        "quant_method": "gptq",
    }
    hf = {**common, "block_name_to_quantize": block_prefix, "modules_in_block_to_quantize": [suffixes],
          "meta": {"quantizer": ["specquant"]}}
    return hf, {**common, "model_file_base_name": "model"}


def read_layer(name: str, tensors: dict[str, torch.Tensor], qc: dict) -> QuantizedWeight:
    """One layer's `QuantizedWeight` from GPTQ tensors (v1 or v2 zero points), shapes and dtypes checked."""
    bits, group_size = int(qc["bits"]), int(qc.get("group_size", -1))
    qweight = tensors.get(f"{name}.qweight")
    if qweight is None or qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError("qweight is missing or not a 2-D int32 tensor")
    in_features, out = qweight.shape[0] * 32 // bits, qweight.shape[1]
    config = QuantConfig(bits=bits, group_size=group_size, symmetric=bool(qc.get("sym", True)))
    n_groups = config.n_groups(in_features)
    scales = require(tensors, f"{name}.scales", torch.float16, (n_groups, out))
    qzeros = require(tensors, f"{name}.qzeros", torch.int32, (n_groups, out * bits // 32))
    codes, zero = unpack_gptq(qweight, qzeros, config, in_features, out)
    if str(qc.get("checkpoint_format", "gptq")).lower() == "gptq_v2":
        zero = (zero - 1) & config.maxq  # v2 stores zero itself; unpack_gptq added v1's 1
    g_idx = tensors.get(f"{name}.g_idx")
    if g_idx is not None:
        g_idx = require(tensors, f"{name}.g_idx", g_idx.dtype, (in_features,)).to(torch.int32)
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= n_groups):
            raise ValueError(f"g_idx values must lie in [0, {n_groups - 1}]")
        trivial = (torch.arange(in_features) // config.resolve_group_size(in_features)).to(torch.int32)
        g_idx = None if torch.equal(g_idx, trivial) else g_idx.contiguous()
    bias = tensors.get(f"{name}.bias")
    if bias is not None:
        bias = require(tensors, f"{name}.bias", bias.dtype, (out,)).float()
    return QuantizedWeight(codes=codes, scale=scales.t().float().contiguous(), zero=zero.contiguous(),
                           config=config, bias=bias, g_idx=g_idx)


def import_recipe(qc: dict, weights: dict[str, QuantizedWeight], record: dict | None) -> QuantRecipe:
    """The recipe our export recorded, else one made from the quantization_config (method gptq)."""
    if record and isinstance(record.get("recipe"), dict):
        try:
            return QuantRecipe.from_dict(record["recipe"])
        except (TypeError, ValueError):
            pass  # an export from another specquant version: fall back to what the format says
    qw = next(iter(weights.values()))
    return QuantRecipe(method="gptq", bits=qw.config.bits, group_size=qw.config.group_size,
                       symmetric=qw.config.symmetric, act_order=bool(qc.get("desc_act", False)),
                       static_groups=bool(qc.get("static_groups", False)),
                       damp_percent=float(qc.get("damp_percent", 0.01)))
