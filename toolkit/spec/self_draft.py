"""The self-draft: a draft model made from the target's own weights, so no second model is fetched or held.

Two independent cuts, combinable:
- `bits` (4 or 8): the decoder layers' Linear weights quantized with RTN on the fly (QuantSpec's idea: the same
  model at low precision agrees with itself most of the time) and run by toolkit.quant's low-bit kernels. A
  quantized target's layers with wider codes are dequantized and re-quantized; those already at `bits` or fewer
  are used as they are (then only the KV cache and `layers` can make the draft cheaper).
- `layers`: run only the first N decoder layers, then the target's final norm and head (an early exit, as in
  LayerSkip / Draft & Verify). On a 135M model a decode step is dominated by per-layer overhead, not bytes, so
  fewer layers is the cut that makes the draft cheaper; acceptance decides whether it pays.

Everything else is the target's own module, shared, not copied: embeddings, final norm, head, rotary tables (and
the decoder layers themselves when they are neither quantized nor cut). The draft's KV cache comes from
`toolkit.kv.make_kv_cache` with the draft's `kv` config (e.g. an int4 cache where that kind exists).
"""

import copy

import torch
from torch import nn

from toolkit.engine.fused_packs import strip_fused
from toolkit.engine.lean_forward import LeanForward
from toolkit.engine.lean_forward import rebind as rebind_lean_forward
from toolkit.errors import InputError
from toolkit.model_state import inherit, peek
from toolkit.quant.model_quant import (
    QuantRecipe,
    quantize_model,
    swap_quantized_modules,
)
from toolkit.quant.qlinear import QuantLinear
from toolkit.quant.vnni import VnniLinear


def _decoder(model) -> nn.Module:
    inner = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(inner, "layers", None), nn.ModuleList):
        raise InputError(f"cannot build a self-draft from {type(model).__name__}: no model.layers",
                         "use spec=draft with a separate draft model, or spec=lookup")
    return inner


def _quantize_layers(layers: list[nn.Module], bits: int, group_size: int) -> list[nn.Module]:
    """Copies of `layers` with their Linear weights RTN-quantized and swapped for QuantLinear."""

    holder = nn.ModuleList([copy.deepcopy(layer) for layer in layers])
    strip_fused(holder)  # the copies' fused fp16 packs (lean forward) would run in place of the quantized layers
    # a quantized target (a checkpoint): wider codes than the draft's go back to float and are re-quantized; codes
    # at or below the draft's width are already what the draft would run, so they stay (the target's own)
    kept = 0
    for parent in list(holder.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear):
                if child.bits > bits:
                    setattr(parent, name, _float_linear(child))
                else:
                    kept += 1
    recipe = QuantRecipe(method="rtn", bits=bits, group_size=group_size, skip=())
    qsd = quantize_model(holder, recipe, progress=False)
    if not len(qsd) and not kept:
        raise InputError(f"no decoder Linear layer could be quantized to int{bits} with group size {group_size}",
                         "pick a spec.group_size that divides the model's hidden size (e.g. 32 or 64)")
    if not len(qsd):
        return list(holder)
    swap_quantized_modules(holder, qsd, QuantLinear.from_quantized)
    return list(holder)


def _float_linear(q) -> nn.Linear:
    """A float Linear holding a QuantLinear's dequantized weight ((q - zero) * scale, fp32) and its bias."""
    weight = q.dequantized_weight()
    bias = getattr(q, "bias", None)
    linear = nn.Linear(q.in_features, q.out_features, bias=bias is not None, device=weight.device)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias.float())
    return linear


def build_self_draft(target, layers: int | None = None, bits: int | None = 4, group_size: int = 64):
    """A causal LM sharing `target`'s modules that runs its first `layers` decoder layers (None: all) with
    weights quantized to `bits` (None: the target's own weights)."""
    inner = _decoder(target)
    total = len(inner.layers)
    n = total if layers is None else int(layers)
    if not 1 <= n <= total:
        raise InputError(f"self-draft layers must be in 1..{total}, got {layers}", "set spec.layers, or null for all")
    if bits not in (None, 4, 8):
        raise InputError(f"self-draft bits must be 4, 8 or null, got {bits}", "use spec.bits=4")
    chosen = list(inner.layers[:n])
    if bits is not None:
        chosen = _quantize_layers(chosen, bits, group_size)
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = n
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[:n])
    # Shallow copies with their own module tables: assigning `layers` or `model` here leaves the target untouched.
    draft_inner = copy.copy(inner)
    draft_inner._modules = dict(inner._modules)
    draft_inner.layers = nn.ModuleList(chosen)
    draft_inner.config = config
    draft = copy.copy(target)
    draft._modules = dict(target._modules)
    draft.model = draft_inner
    draft.config = config
    # a compiled target forward would run the target: the draft has none
    inherit(draft, target, decode_forward=None,
            self_draft={"layers": n, "of": total, "bits": bits, "group_size": group_size})
    rebind_lean_forward(draft)  # and so would the target's lean forward
    return draft


def describe(draft) -> str:

    head = draft.get_output_embeddings()  # spec.head_bits: a QuantLinear, or a VnniLinear with spec.act_bits=8
    subset = getattr(head, "ids", None) if hasattr(head, "vocab_ids") else None  # spec.head_vocab: a SubsetHead
    if subset is not None:
        head = head.main
    if isinstance(head, VnniLinear):
        head = f", int{head.bits} head (int8 activations)"
    else:
        head = f", int{head.bits} head" if isinstance(head, QuantLinear) else ""
    if subset is not None:
        head += f" over {len(subset)} frequent tokens + the context's"
    forward = draft.__dict__.get("forward")
    native = forward.native_decoder() if isinstance(forward, LeanForward) else None
    acts = ", int8 activations" if native is not None and native.w4a8 else ""  # spec.act_bits
    info = peek(draft).self_draft
    if info is None:
        return type(draft).__name__ + acts + head
    weights = f"int{info['bits']} g{info['group_size']}" if info["bits"] else "target weights"
    return f"self-draft: {info['layers']}/{info['of']} layers, {weights}{acts}{head}"

