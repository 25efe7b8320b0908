"""The AWQ GEMM checkpoint format (AutoAWQ's ``version: gemm``; transformers loads it through gptqmodel).

Per quantized Linear ``NAME``, with ``W ~= (q - zero) * scale`` as everywhere in specquant:

* ``NAME.qweight`` int32 ``[in, out/8]``: row ``i`` holds the codes of input ``i`` for all outputs, 8 outputs per
  word, packed along the OUTPUT dim in the interleaved order ``AWQ_ORDER``: the nibble at bits ``4k..4k+3`` of
  word ``j`` holds output ``8j + AWQ_ORDER[k]`` (the order AutoAWQ's GEMM kernel dequantizes in).
* ``NAME.qzeros``  int32 ``[n_groups, out/8]``: the zero points packed the same way, stored as they are (no -1).
* ``NAME.scales``  fp16 ``[n_groups, out]``.
* ``NAME.bias``    fp16 ``[out]`` when the layer has one.

``config.json`` carries ``quantization_config`` {quant_method awq, version gemm, bits, group_size, zero_point},
and ``quant_config.json`` AutoAWQ's own naming (w_bit, q_group_size). What fits: 4-bit codes with groups
(group_size > 0), no act-order, ``out_features % 8 == 0``; symmetric weights are stored as zero points of 8.
Scales are rounded to fp16 as in the GPTQ format; codes and zero points are exact.
"""

from __future__ import annotations

import torch

from toolkit.quant.formats.common import (
    ExportError,
    ragged_fix,
    ragged_message,
    require,
)
from toolkit.quant.model_quant import METHODS, QuantizedStateDict, QuantRecipe
from toolkit.quant.primitives import QuantConfig, gptq_scales
from toolkit.quant.quantized_weight import QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # argsort of AWQ_ORDER: undoes it on unpacking
QUANT_CONFIG = "quant_config.json"
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)


def pack_awq_gemm(values: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit values ``[rows, cols]`` into int32 ``[rows, cols/8]`` in AWQ's interleaved nibble order."""
    if values.dim() != 2 or values.shape[1] % 8:
        raise ValueError(f"AWQ packing needs a 2-D tensor with columns divisible by 8, got {tuple(values.shape)}")
    v = values.to(torch.int64)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) > 15):
        raise ValueError("AWQ GEMM values must be 4-bit codes in [0, 15]")
    v = v.reshape(v.shape[0], -1, 8)[..., list(AWQ_ORDER)]
    words = (v << _SHIFTS).sum(dim=-1)  # nibbles never overlap, so the sum is the bitwise or
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # the int32 with the same bits
    return words.to(torch.int32)


def unpack_awq_gemm(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_awq_gemm`: int32 ``[rows, cols/8]`` -> uint8 ``[rows, cols]``."""
    if words.dim() != 2 or words.dtype != torch.int32:
        raise ValueError(f"AWQ words must be a 2-D int32 tensor, got {words.dtype} {tuple(words.shape)}")
    nibbles = ((words.to(torch.int64) & 0xFFFFFFFF)[..., None] >> _SHIFTS) & 0xF
    return nibbles[..., list(AWQ_REVERSE_ORDER)].reshape(words.shape[0], -1).to(torch.uint8)


def check_exportable(qsd: QuantizedStateDict) -> None:
    """Raise ExportError naming the first layer the AWQ GEMM format cannot hold, and why."""
    for name, qw in qsd.weights.items():
        if qw.config.bits != 4:
            raise ExportError(f"{name}: {qw.config.bits}-bit codes; the AWQ GEMM format holds 4 bits only",
                              "export format=gptq (2/3/4/8 bits)")
        if qw.config.group_size == -1:
            raise ExportError(f"{name}: one group per output channel (group_size=-1); AWQ GEMM needs groups",
                              "export format=gptq, or re-quantize with group_size 32/64/128")
        if not qw.config.divides(qw.in_features):
            raise ExportError(ragged_message(name, qw, "AWQ"), ragged_fix(qw))
        trivial = torch.arange(qw.in_features) // qw.config.group_size
        if qw.g_idx is not None and not torch.equal(qw.g_idx.cpu().long(), trivial):
            raise ExportError(f"{name}: act-order (g_idx) weights; AWQ GEMM has no g_idx",
                              "export format=gptq, which stores g_idx")
        if qw.out_features % 8:
            raise ExportError(f"{name}: out_features={qw.out_features} is not a multiple of 8",
                              "skip that layer when quantizing (recipe.skip)")
    sizes = {qw.config.group_size for qw in qsd.weights.values()}
    if len(sizes) != 1:
        raise ExportError(f"layers use different group sizes {sorted(sizes)}; AWQ has one per model",
                          "re-quantize with one group size")


def layer_tensors(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The AWQ GEMM tensors of one quantized layer, keyed ``NAME.qweight`` etc."""
    out = {f"{name}.qweight": pack_awq_gemm(qw.codes.cpu().t()),
           f"{name}.qzeros": pack_awq_gemm(qw.zero.cpu().t()),
           f"{name}.scales": gptq_scales(qw.scale.cpu())}
    if qw.bias is not None:
        out[f"{name}.bias"] = qw.bias.detach().cpu().to(torch.float16)
    return out


def quantization_config(qsd: QuantizedStateDict, not_converted: list[str]) -> tuple[dict, dict]:
    """``(config.json quantization_config, quant_config.json)``; ``not_converted`` = Linear layers left in float."""
    gs = next(iter(qsd.weights.values())).config.group_size
    hf = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": gs, "zero_point": True, "sym": False,
          "modules_to_not_convert": not_converted}
    return hf, {"zero_point": True, "q_group_size": gs, "w_bit": 4, "version": "GEMM"}


def read_layer(name: str, tensors: dict[str, torch.Tensor], qc: dict) -> QuantizedWeight:
    """One layer's `QuantizedWeight` from AWQ GEMM tensors, shapes and dtypes checked."""
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if bits != 4:
        raise ValueError(f"{bits}-bit AWQ; the GEMM layout read here is 4-bit")
    qweight = tensors.get(f"{name}.qweight")
    if qweight is None or qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError("qweight is missing or not a 2-D int32 tensor")
    in_features, out = qweight.shape[0], qweight.shape[1] * 8
    config = QuantConfig(bits=4, group_size=group_size, symmetric=False)
    n_groups = config.n_groups(in_features)
    scales = require(tensors, f"{name}.scales", torch.float16, (n_groups, out))
    qzeros = require(tensors, f"{name}.qzeros", torch.int32, (n_groups, out // 8))
    bias = tensors.get(f"{name}.bias")
    if bias is not None:
        bias = require(tensors, f"{name}.bias", bias.dtype, (out,)).float()
    return QuantizedWeight(codes=unpack_awq_gemm(qweight).t().contiguous(),
                           scale=scales.t().float().contiguous(),
                           zero=unpack_awq_gemm(qzeros).t().to(torch.int32).contiguous(),
                           config=config, bias=bias)


def check_importable(qc: dict) -> None:
    version = str(qc.get("version", qc.get("format", "gemm"))).lower()
    if version != "gemm":
        raise ExportError(f"AWQ version {version!r}; specquant reads the GEMM layout only",
                          "convert the checkpoint to AWQ GEMM (AutoAWQ version='GEMM')")
    if qc.get("zero_point", True) is False:
        raise ExportError("AWQ checkpoint without zero points (zero_point false); specquant reads zero_point true",
                          "re-quantize with zero_point=True")


def import_recipe(qc: dict, weights: dict[str, QuantizedWeight], record: dict | None) -> QuantRecipe:
    """The recipe our export recorded, else one made from the quantization_config."""
    if record and isinstance(record.get("recipe"), dict):
        try:
            return QuantRecipe.from_dict(record["recipe"])
        except (TypeError, ValueError):
            pass
    gs = next(iter(weights.values())).config.group_size
    # the format says "awq"; until specquant's own AWQ lands in METHODS, the codes are recorded as round-to-nearest
    # codes (the recipe's method only labels results; the codes are used as they are)
    method = "awq" if "awq" in METHODS else "rtn"
    return QuantRecipe(method=method, bits=4, group_size=gs, symmetric=False)
