"""Fused projections for the lean forward (`toolkit.engine.lean_forward`): each decoder layer's q,k,v and gate,up
products as one kernel call each, 4 calls a layer instead of 7.

With fp16 weights run by fbgemm (the engine default on x86) the layers' weights become one fbgemm pack
(`FusedPack`). A 1-row fbgemm call has a fixed cost that small layers (SmolLM2's k_proj is 192x576) never amortize;
`python -m benchmarks.forward` prints layer 0's fused and separate calls side by side. fbgemm may block the wider
product's sum differently, so fused results are the separate layers' within fp32 rounding (on SmolLM2's shapes,
bit-identical). The fused pack replaces the separate layers' packs (the memory stays what it was); those layers
keep their fp16 weights for the transformers forward and for products of FBGEMM_MAX_ROWS rows or more, which the
lean forward sends to them unfused. A pack is used only while the model holds the very layers it packed (a swapped
layer makes it stale). Int4 QuantLinear layers (a quantized checkpoint, the int4 self-draft) get the same two
packs, `Int4N8Pack` on specquant's int4 GEMM and `Int4Pack` on torch's int4 kernel, and int8 per-channel layers on
specquant's int8 GEMM an `Int8Pack`: these layouts are blocked along the output dim, so the stacked packs are the
stacked weights' pack, bit-identical to the separate layers (checked when made, and tested).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from toolkit.engine.module_swaps import bump
from toolkit.engine.precision import BF16_DEQUANT_MIN_ROWS, HalfStorageLinear
from toolkit.quant import int4_native, int8_native
from toolkit.quant.qlinear import QuantLinear, int4pack_mm

__all__ = ["FusedPack", "Int4N8Pack", "Int4Pack", "Int8Pack", "fuse_projections", "layer_pack", "on_int8_gemm",
           "pack_for", "strip_fused"]


def _gathered(x: torch.Tensor, in_perm: torch.Tensor | None) -> torch.Tensor:
    """x with its last dim in an act-order pack's column order (`QuantLinear.in_perm`), or x itself."""
    return x if in_perm is None else x.index_select(-1, in_perm)


@dataclass(frozen=True, eq=False, kw_only=True)
class _Pack:
    """What every fused pack holds beside its weights; calling it splits its product back into its layers' outputs."""
    sizes: tuple[int, ...]  # each layer's out_features, in order
    max_rows: int  # fewer rows than this run the pack
    sources: tuple  # the layers packed: a pack is used only while the model still holds exactly these

    def run(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.run(x).split(self.sizes, dim=-1)


@dataclass(frozen=True, eq=False, kw_only=True)
class FusedPack(_Pack):
    """One fbgemm fp16 pack of several Linear layers' weights stacked along the output dim."""
    packed: torch.Tensor

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)


@dataclass(frozen=True, eq=False, kw_only=True)
class _QuantPack(_Pack):
    """A pack of QuantLinear layers: their fp32 biases stacked (`_stacked_bias`), and the input order act-order
    layers' columns share."""
    bias: torch.Tensor | None
    in_perm: torch.Tensor | None = None

    def _on_rows(self, x: torch.Tensor, product) -> torch.Tensor:
        """`product` (a kernel taking fp32 rows [rows, in]) applied to x [..., in] gathered in the pack's column
        order, in x's dtype and leading shape."""
        x = _gathered(x, self.in_perm)
        y = product(x.reshape(-1, x.shape[-1]))
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


@dataclass(frozen=True, eq=False, kw_only=True)
class Int4Pack(_QuantPack):
    """One int4 packed weight (torch's CPU int4pack layout) of several QuantLinear layers stacked along the output
    dim, run as QuantLinear's kernel path runs each of them (bf16 activations, its group size, fp32 bias after)."""
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group: int

    def run(self, x: torch.Tensor) -> torch.Tensor:
        x = _gathered(x, self.in_perm)
        rows = x.numel() // x.shape[-1]
        y = int4pack_mm(x.reshape(rows, x.shape[-1]), self.packed, self.group, self.scales_and_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])


@dataclass(frozen=True, eq=False, kw_only=True)
class Int4N8Pack(_QuantPack):
    """Several QuantLinear layers on specquant's int4 GEMM (``"int4n8"``, `toolkit.quant.int4_native`) stacked
    along the output dim: the n8 layout is block-major along it, so the stacked packs are the pack of the stacked
    weights. Runs as each layer's kernel path does (fp32 activations, bias in the kernel)."""
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group: int

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self._on_rows(x, lambda x2: int4_native.linear(x2, self.codes, self.scale, self.zero, self.group,
                                                              self.bias))


@dataclass(frozen=True, eq=False, kw_only=True)
class Int8Pack(_QuantPack):
    """Several int8 per-channel QuantLinear layers on specquant's int8 GEMM (`toolkit.quant.int8_native`) stacked along
    the output dim: per-channel codes and scales stack row by row, the codes packed again in the kernel's h16 order.
    Runs as each layer's kernel path does (fp32 activations, bias in the kernel); like the int4 packs it is a copy
    (1 byte per weight of q,k,v and gate,up), and a decode step reads only it."""
    weight: torch.Tensor
    scale: torch.Tensor

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self._on_rows(x, lambda x2: int8_native.linear(x2, self.weight, self.scale, self.bias))


def _stacked_bias(modules) -> torch.Tensor | None:
    """The layers' fp32 biases stacked along the output dim (zeros for a layer without one), or None if none has one."""
    if all(m.bias is None for m in modules):
        return None
    return torch.cat([(m.bias.float() if m.bias is not None else torch.zeros(m.out_features)) for m in modules])


def _quant_pack_fields(modules) -> dict:
    """The fields every pack of QuantLinear layers takes from its layers (the first one's input order and row limit,
    which the pack's makers checked all share)."""
    first = modules[0]
    return {"bias": _stacked_bias(modules), "sizes": tuple(m.out_features for m in modules),
            "max_rows": first.kernel_max_rows, "sources": tuple(modules), "in_perm": first.in_perm}


def _same_in_perm(m, first) -> bool:
    """Whether layer `m` gathers its inputs as `first` does (`QuantLinear.in_perm`, both None or equal): only such
    layers can share a pack (q,k,v and gate,up read one Hessian, so act-order GPTQ orders their columns alike)."""
    if m.in_perm is None or first.in_perm is None:
        return m.in_perm is first.in_perm
    return torch.equal(m.in_perm, first.in_perm)


def _checked(pack, modules):
    """`pack` if a trial product equals the separate layers' bit for bit, else None."""
    trial = torch.randn(1, modules[0].in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        if not torch.equal(pack.run(trial), torch.cat([m(trial) for m in modules], dim=-1)):
            return None
    return pack


def _fuse_int4n8(modules) -> Int4N8Pack | None:
    first = modules[0]
    if not all(type(m) is QuantLinear and m.kernel == "int4n8" and not hasattr(m, "g_idx")
               and m.in_features == first.in_features
               and m.group_size == first.group_size and m.kernel_max_rows == first.kernel_max_rows
               and m.weight_int4n8.device.type == "cpu" and _same_in_perm(m, first) for m in modules):
        return None
    return _checked(Int4N8Pack(codes=torch.cat([m.weight_int4n8 for m in modules]),
                               scale=torch.cat([m.scale for m in modules]), zero=torch.cat([m.zero for m in modules]),
                               group=first.group_size, **_quant_pack_fields(modules)), modules)


def on_int8_gemm(module) -> bool:
    """Whether `module` is an int8 per-channel QuantLinear on specquant's int8 GEMM (what Int8Pack and the native
    decoder's int8 products take)."""
    return type(module) is QuantLinear and module.kernel == "int8pack" and module.int8_native


def _fuse_int8(modules) -> Int8Pack | None:
    """An Int8Pack of int8 QuantLinear layers on specquant's int8 GEMM with one input width, or None."""
    first = modules[0]
    if not all(on_int8_gemm(m) and m.in_features == first.in_features and m.kernel_max_rows == first.kernel_max_rows
               and m.weight_int8_h16.device.type == "cpu" and _same_in_perm(m, first) for m in modules):
        return None
    return _checked(Int8Pack(weight=int8_native.pack(torch.cat([m.int8_rows() for m in modules])),
                             scale=torch.cat([m.scale for m in modules]).contiguous(), **_quant_pack_fields(modules)),
                    modules)


def _fuse_int4(modules) -> Int4Pack | Int4N8Pack | None:
    """An Int4Pack of QuantLinear layers that run torch's int4 kernel on the same input width and group (an
    Int4N8Pack of layers on specquant's int4 GEMM, `_fuse_int4n8`), or None.
    The packed layout is blocked along the output dim, so stacking the layers' packs is the pack of their stacked
    weights; a trial product against the separate layers confirms it (bit for bit) before the pack is used. Unlike
    fbgemm's, the layers keep their own packs (their dequantize path for wide products reads them): the fused copy
    adds half a byte per weight of q,k,v and gate,up, and a decode step reads only the fused one."""
    if all(type(m) is QuantLinear and m.kernel == "int4n8" for m in modules):
        return _fuse_int4n8(modules)
    first = modules[0]
    if not all(type(m) is QuantLinear and m.kernel == "int4pack" and m._code_layout == "packed"
               and not hasattr(m, "g_idx") and m.kernel_in == m.in_features == first.in_features
               and m.kernel_group_size == first.kernel_group_size and m.kernel_max_rows == first.kernel_max_rows
               and m.weight_int4pack.device.type == "cpu" and _same_in_perm(m, first) for m in modules):
        return None
    return _checked(Int4Pack(packed=torch.cat([m.weight_int4pack for m in modules]),
                             scales_and_zeros=torch.cat([m.scales_and_zeros for m in modules], dim=1).contiguous(),
                             group=first.kernel_group_size, **_quant_pack_fields(modules)), modules)


def _fuse(modules) -> FusedPack | Int4Pack | Int4N8Pack | Int8Pack | None:
    if not all(type(m) is HalfStorageLinear and getattr(m, "fbgemm_fp16", None) is not None for m in modules):
        return _fuse_int8(modules) or _fuse_int4(modules)
    weight = torch.cat([m.weight.detach().float() for m in modules])
    biases = [m.bias for m in modules]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([(b.detach().float() if b is not None else torch.zeros(m.out_features))
                          for m, b in zip(modules, biases)])
    packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)
    for m in modules:
        del m.fbgemm_fp16  # the fused pack replaces it: memory stays what it was
    return FusedPack(packed=packed, sizes=tuple(m.out_features for m in modules), max_rows=modules[0].fbgemm_max_rows,
                     sources=tuple(modules))


_PACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""attention or MLP module -> {"qkv" | "gate_up": its fused pack}: kept beside the modules, not on them, so a copy
of a module (a self-draft's quantized layer) starts without its original's packs."""


def fused_pack(module, name: str):
    """`module`'s fused pack `name` ("qkv" or "gate_up") as made, stale or not, or None."""
    return _PACKS.get(module, {}).get(name)


def set_fused_pack(module, name: str, pack) -> None:
    """Give `module` the fused pack `name` (None: none)."""
    _PACKS.setdefault(module, {})[name] = pack


def fuse_projections(model) -> int:
    """Give each decoder layer of a lean-supported model fused q,k,v and gate,up packs, fbgemm fp16 (see the module
    docstring), int8 (`Int8Pack`) or int4 (`Int4Pack`, `Int4N8Pack`); returns how many packs were made (0 where the
    layers are none of these)."""
    made = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for module, name, layers in ((attn, "qkv", [attn.q_proj, attn.k_proj, attn.v_proj]),
                                     (mlp, "gate_up", [mlp.gate_proj, mlp.up_proj])):
            if fused_pack(module, name) is None:
                set_fused_pack(module, name, _fuse(layers))
                made += fused_pack(module, name) is not None
    bump()
    return made


def layer_pack(module, name: str, *layers) -> FusedPack | Int4Pack | Int4N8Pack | Int8Pack | None:
    """`module`'s fused pack of `layers`, or None. A layer swapped since the pack was made (a self-draft's quantized
    copy) makes it stale: then the layers run themselves. fbgemm computes in fp32, so exact_linears (an fp16
    overflow's rerun) keeps a fused pack, as it keeps the separate layers' packs."""
    pack = fused_pack(module, name)
    if pack is None or any(a is not b for a, b in zip(pack.sources, layers)):
        return None
    return pack


def pack_for(pack, rows: int, bf16: bool):
    """The fused pack a product of `rows` rows runs on, or None (the layers run themselves): a pack serves fewer
    rows than its `max_rows`. In a bf16 prompt pass fp16 packs give way to their layers' bf16 products, int4 packs
    from BF16_DEQUANT_MIN_ROWS rows (their layers' bf16 dequantize path); int8 packs keep their exact kernel."""
    if pack is None or rows >= pack.max_rows:
        return None
    if bf16 and (type(pack) is FusedPack or (type(pack) is not Int8Pack and rows >= BF16_DEQUANT_MIN_ROWS)):
        return None
    return pack


def strip_fused(module) -> None:
    """Drop the fused packs under `module` (a copy whose layers are about to be swapped: they would be stale)."""
    for child in module.modules():
        _PACKS.pop(child, None)
    bump()
