"""A whole decoder stack in one C call per forward (toolkit/kernels/decoder_layers.c): the lean forward's "native"
path for int4 and int8 checkpoints, the int4 self-draft, and float models at the engine's default precision (fp16
weights, fp32 activations).

Why: with int4 weights on specquant's GEMM, a SmolLM2-135M decode step through torch ops spent ~17 ms against a
~4 ms bandwidth floor; what remained was ~40 small operators per layer (norms, rotary, cache writes, attention,
residuals), each a dispatch, an allocation and a thread fork, not the weights. Here each layer is four GEMMs
(int4: `toolkit.quant.int4_native` or `toolkit.quant.vnni`; int8: `toolkit.quant.int8_native`; fp16:
`toolkit.quant.half_native`) and a few C loops.
The float model gains the same way: its decode step went from ~14.4-14.9 ms through torch ops to ~7.7-7.9 ms
(`python benchmarks/engine_native_decoder.py smollm2-135m`). `python benchmarks/engine_native_decoder.py
[MODEL]` times it against the lean forward's torch path on the same model and cache.

When it runs (`NativeDecoder.applies`; anything else takes the lean forward's torch path, same model):
- every decoder layer's q,k,v and gate,up are fused `Int4N8Pack`s and o, down `"int4n8"` QuantLinear layers (a
  quantized int4 checkpoint or the int4 self-draft on specquant's kernels), or fused `Int8Pack`s and int8
  QuantLinear layers on specquant's int8 GEMM (an int8 per-channel checkpoint), or all four are fp16 products on
  fbgemm (fused `FusedPack`s and fp16-stored `HalfStorageLinear`s: the engine's default float precision on x86),
  which the stack runs from h16 packs of the same fp16 weights (made once per layer and kept on it: a second fp16
  copy of the decoder's weights, 212 MB for SmolLM2) where the CPU has AVX2 + F16C (`engine.native_dot=bf16`: b16 packs
  of the weights rounded to bf16 instead, on `toolkit.quant.bf16_native`, AVX512-BF16); its norms RMSNorms, its
  activation SiLU, full rotary (no partial rotary, no sliding windows: what the lean forward already requires);
- activations in fp32, the KV cache in fp32 or fp16 (`kv.dtype`, docs/kv-cache.md: read into fp32 as attention
  goes), one sequence (batch 1, no padding mask), the cache a `ContiguousKVCache`
  already holding the prompt, or a KIVI `QuantizedKVCache` holding it whose codes the stack reads
  (`toolkit.engine.native_kv`; the paged cache takes the torch path), fewer new rows than the
  packs' `max_rows` (decode, verify passes, short prompts). A stack whose products all run w4a8 (below) also runs
  the prompt into an empty cache, up to `W4A8_MAX_ROWS` rows: there the integer kernel beats dequantize + fp32
  F.linear at any row count (a 126-token prompt of Qwen2.5-Coder-0.5B int4: 0.24-0.27 s against 1.29-1.34 s). An
  all-fp16, bf16 or exact int8 stack runs prompts up to that bound too: its kernel beats the torch path.

A draft's stack (`spec.act_bits=8`: `LeanForward.native_activations = "int8"`), and a target's at
`engine.native_dot=int8`, runs its products on the w4a8 kernel instead (`toolkit.quant.vnni`: activations rounded to
int8 per group, integer dot products on AVX2 or AVX512-VNNI; the v16 packs are made from the n8 ones once per pack):
an approximation of the fp32 product, row-independent all the same, so speculation on such a target stays
token-identical to the same target without it.

Numbers: the same model in fp32, within fp32 rounding of transformers' forward (sums in another order; tested on
the logits), not bit-identical to it. Rows are independent by construction: row i's result is the same whatever
the number of rows fed beside it, so a speculative verify pass gives each position exactly what one-row decoding
gives, and speculative greedy output stays token-identical to the target alone (tested).
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from functools import lru_cache

import torch
import torch.nn.functional as F

from toolkit import cbuild, cpu
from toolkit.engine import native_kv
from toolkit.engine.fused_packs import FusedPack, Int4N8Pack, Int8Pack, on_int8_gemm
from toolkit.engine.precision import HalfStorageLinear
from toolkit.kv.contiguous import ContiguousKVLayer
from toolkit.quant import bf16_native, half_native, int4_native, vnni
from toolkit.quant.qlinear import QuantLinear

log = logging.getLogger(__name__)

SOURCE = cbuild.source("decoder_layers.c")  # it #includes the five GEMMs beside it
FLAGS = [*int4_native.FLAGS, "-lm"]  # the int4 GEMM's flags (no FP contraction: row independence), and libm
ACTIVATIONS = ("fp32", "int8")
DOTS = ("fp32", "bf16")  # a float model's products: fp16 weights x fp32 (h16), or bf16 x bf16 summed in fp32 (b16)


N8, W4A8, H16, I8, B16, W8A8 = 0, 1, 2, 3, 4, 5  # a product's kind (`_Q4.kind`), as decoder_layers.c dispatches it
INT8_ACTIVATIONS = (W4A8, W8A8)  # the kinds whose activations are rounded to int8 (vnni_gemm.c)
# per `DOTS` setting, a float model's products: their kernel module, the attribute a layer keeps its pack in, the kind
_HALF = {"fp32": (half_native, "specquant_h16", H16), "bf16": (bf16_native, "specquant_b16", B16)}


class _Q4(ctypes.Structure):
    """One product: an int4 n8 pack (`toolkit.quant.int4_native`, kind N8), a v16 pack (`toolkit.quant.vnni`, int8
    activations, kind W4A8), an fp16 h16 pack in `codes` (`toolkit.quant.half_native`, kind H16; no scale, zero or
    group) or int8 per-channel codes in the h16 order in `codes` with fp32 scales (`toolkit.quant.int8_native`, kind
    I8; no zero or group); its fp32 bias or NULL, out, in and group; an act-order product's column order (int32,
    `QuantLinear.in_perm`) or NULL."""
    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("g", ctypes.c_int64),
                ("kind", ctypes.c_int64), ("perm", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", _Q4), ("o", _Q4),
                ("gate_up", _Q4), ("down", _Q4)]


KV_DTYPES = {torch.float32: 0, torch.float16: 1}  # a cache's dtype -> the kernel's kv_half


class _Dims(ctypes.Structure):
    _fields_ = [("d", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("inter", ctypes.c_int64), ("cap", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scaling", ctypes.c_float), ("kv_half", ctypes.c_int64)]


def load():
    """Build (once per source, flags and CPU) and load the library, or None with a warning."""
    lib = cbuild.load_library(SOURCE, "decoder-layers", list(FLAGS), "native decoder",
                              "models run the lean forward's torch operators", log)
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.sq_decoder_layers.argtypes = [p, i64, p, p, i64, p, p, p, p, i64]
    lib.sq_decoder_layers.restype = ctypes.c_int
    lib.sq_decoder_layers_kvq.argtypes = [p, i64, p, p, i64, p, p, p, p, i64]
    lib.sq_decoder_layers_kvq.restype = ctypes.c_int
    lib.sq_b16_linear.argtypes = [p, i64, i64, p, p, i64, p]  # the bf16 kernel it includes: its AMX switch and test
    lib.sq_b16_amx.argtypes = [ctypes.c_int]
    lib.sq_decoder_timing.argtypes = [ctypes.c_int, p]
    lib.sq_int_scores_built.restype = ctypes.c_int
    bf16_native.use_amx(lib)
    return lib


@lru_cache(maxsize=1)
def library():
    return load() if int4_native.available() else None


def int_scores_built() -> bool:
    """Whether this build reads a KIVI cache's grouped codes in integers at int8 activations (AVX512-VNNI)."""
    lib = library()
    return lib is not None and bool(lib.sq_int_scores_built())


PHASES = ("norms and residuals", "products", "rotary and cache writes", "attention", "SiLU x up")
"""The stack's phases, as `decoder_layers.c` times them when asked (`phase_timing`)."""


def phase_timing(on: bool) -> dict[str, float]:
    """Seconds the native stack spent in each of `PHASES` since timing was last switched on; `on` switches it on
    (from zero) or off. A clock read per phase while on; nothing while off (benchmarks/ttft_profile.py)."""
    lib = library()
    if lib is None:
        return {}
    out = (ctypes.c_double * len(PHASES))()
    lib.sq_decoder_timing(int(on), out)
    return dict(zip(PHASES, out))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _q4(codes, scale, zero, bias, group: int, in_perm, keep: list, activations: str = "fp32") -> _Q4:
    """The struct of one n8 product; with int8 activations its v16 pack where the layout holds it (kept alive in
    `keep`), else the n8 pack as it is. `in_perm`: an act-order product's column order (int32), or None."""
    n, k = codes.shape[0] * int4_native.BLOCK_N, codes.shape[1] * 2
    perm = _perm_ptr(in_perm, keep)
    if activations == "int8":
        v16 = _v16(codes, scale, zero, group)
        if v16 is not None:
            keep.extend(v16)
            return _Q4(*(t.data_ptr() for t in v16), _ptr(bias), n, k, group, W4A8, perm)
    return _Q4(codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), _ptr(bias), n, k, group, N8, perm)


def _perm_ptr(in_perm, keep: list):
    """The C pointer of an act-order column order (`QuantLinear.in_perm`, int32 contiguous), kept alive; or None."""
    if in_perm is None:
        return None
    if in_perm.dtype != torch.int32 or not in_perm.is_contiguous():
        raise ValueError("an act-order column order must be int32 and contiguous")
    keep.append(in_perm)
    return in_perm.data_ptr()


def _half_pack(weights: list[torch.Tensor], biases: list[torch.Tensor | None], owner,
              dot: str = "fp32") -> tuple | None:
    """(h16 pack, fp32 bias or None) of fp16 `weights` stacked along the output dim (their biases too), made once and
    kept on `owner` while it holds these very weights (plans are rebuilt often, packs once); None where the kernel is
    unavailable or the layout cannot hold them. `dot="bf16"`: the b16 pack of the same weights rounded to bf16
    (`toolkit.quant.bf16_native`) instead; an owner keeps one of the two."""
    kernel, attribute, _ = _HALF[dot]
    if not kernel.available() or any(w.dtype != torch.float16 for w in weights):
        return None
    n, k = sum(w.shape[0] for w in weights), weights[0].shape[1]
    if not kernel.supports(n, k) or any(w.shape[1] != k for w in weights):
        return None
    cached = getattr(owner, attribute, None)
    if cached is None or len(cached[0]) != len(weights) or any(a is not b for a, b in zip(cached[0], weights)):
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach().float() if b is not None else torch.zeros(w.shape[0])
                              for w, b in zip(weights, biases)]).contiguous()
        packed = kernel.pack(torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0])
        cached = (tuple(weights), packed, bias)
        setattr(owner, attribute, cached)
        # one setting runs at a time: the other settings' packs (second copies of the weights) go
        for _, other, _ in _HALF.values():
            if other != attribute and hasattr(owner, other):
                delattr(owner, other)
    return cached[1], cached[2]


def _half_product(pack, modules: list, owner, keep: list, dot: str = "fp32") -> _Q4 | None:
    """An fp16 product (engine precision fp16 weights, fp32 activations: fbgemm's fused pack or an fp16-stored
    Linear on it) as an h16 product (`dot="bf16"`: a b16 product), or None."""

    if pack is not None and type(pack) is not FusedPack:
        return None
    if any(type(m) is not HalfStorageLinear for m in modules):
        return None
    if pack is None and getattr(modules[0], "fbgemm_fp16", None) is None:  # a fused pack took over its layers' own
        return None
    made = _half_pack([m.weight for m in modules], [m.bias for m in modules], owner, dot)
    if made is None:
        return None
    packed, bias = made
    keep += [t for t in made if t is not None]
    return _Q4(packed.data_ptr(), None, None, _ptr(bias), sum(m.weight.shape[0] for m in modules),
               modules[0].weight.shape[1], 0, _HALF[dot][2])


W4A8_MAX_ROWS = 2048

# id(n8 codes or int8 h16 pack) -> (weakref to them, group (negated for int8), v16 pack): plans are rebuilt often,
# packs once
_V16: dict[int, tuple] = {}


def _drop_dead_packs() -> None:
    for key in [key for key, (ref, _, _) in _V16.items() if ref() is None]:
        del _V16[key]


def _v16(codes, scale, zero, group: int) -> tuple | None:
    """The v16 pack of an n8 pack (`vnni.from_n8`), made once per pack, or None where w4a8 cannot run it."""
    if not vnni.available():
        return None
    hit = _V16.get(id(codes))
    if hit is not None and hit[0]() is codes and hit[1] == group:
        return hit[2]
    _drop_dead_packs()
    v16 = vnni.from_n8(codes, scale, zero, group)
    _V16[id(codes)] = (weakref.ref(codes), group, v16)
    return v16


W8A8_GROUPS = (128, 64, 32)
"""An int8 checkpoint's activations at engine.native_dot=int8 are rounded to int8 per group of columns, the first of
these that divides the input width (its weights are per channel, so the weight's scale repeats over the groups)."""


def _w8a8_group(k: int) -> int | None:
    return next((g for g in W8A8_GROUPS if k % g == 0), None)


def _v16_int8(key: torch.Tensor, rows, scale: torch.Tensor) -> tuple | None:
    """(codes, scale, zero, group): the 8-bit v16 pack of int8 per-channel codes (`rows()`: [n, k] int8) and their
    scales, made once per `key` (the h16 pack they come from), or None where the w8a8 kernel cannot run them (no
    AVX512-VNNI, or the layout)."""
    if not vnni.available(bits=8):
        return None
    hit = _V16.get(id(key))
    if hit is not None and hit[0]() is key and hit[1] < 0:
        return hit[2]
    _drop_dead_packs()
    codes = rows()
    n, k = codes.shape
    group = _w8a8_group(k)
    if group is None or not vnni.supports(n, k, group):
        return None
    groups = k // group
    v16 = vnni.pack((codes.to(torch.int16) + 128).to(torch.uint8), scale.float().reshape(n, 1).expand(n, groups),
                    torch.full((n, groups), 128, dtype=torch.uint8), group, bits=8)
    made = (*v16, group)
    _V16[id(key)] = (weakref.ref(key), -group, made)  # the group negated: not an int4 pack's entry
    return made


def _single(layer) -> tuple | None:
    """(codes, scale, zero, bias, group) of an "int4n8" QuantLinear run by the kernel, else None."""

    if type(layer) is not QuantLinear or layer.kernel != "int4n8" or hasattr(layer, "g_idx"):
        return None
    bias = None if layer.bias is None else layer.bias.float().contiguous()
    return layer.weight_int4n8, layer.scale, layer.zero, bias, layer.group_size, layer.in_perm


def _int4_products(plan, keep: list, activations: str) -> tuple[_Q4, ...] | None:
    """A layer's (q,k,v, o, gate,up, down) structs where all four are int4 on specquant's kernel, else None."""

    qkv, gate_up, o, down = plan.qkv, plan.gate_up, _single(plan.o), _single(plan.down)
    if not (type(qkv) is Int4N8Pack and type(gate_up) is Int4N8Pack and o and down):
        return None
    keep += [t for t in (qkv.bias, gate_up.bias, o[3], down[3]) if t is not None]
    return (_q4(qkv.codes, qkv.scale, qkv.zero, qkv.bias, qkv.group, qkv.in_perm, keep, activations),
            _q4(*o, keep, activations),
            _q4(gate_up.codes, gate_up.scale, gate_up.zero, gate_up.bias, gate_up.group, gate_up.in_perm, keep,
                activations),
            _q4(*down, keep, activations))


def _int8_single(layer) -> tuple | None:
    """(packed codes, scale, bias, in_perm) of an int8 QuantLinear on specquant's int8 GEMM, else None."""

    return (layer.weight_int8_h16, layer.scale, layer.bias, layer.in_perm) if on_int8_gemm(layer) else None


def _int8_products(plan, keep: list, activations: str = "fp32") -> tuple[_Q4, ...] | None:
    """A layer's structs where all four products are int8 on specquant's int8 GEMM (fused `Int8Pack`s for q,k,v and
    gate,up), else None. `activations="int8"` (engine.native_dot=int8): each product on the w8a8 kernel where it
    runs (`_v16_int8`), else on the exact one."""

    qkv, gate_up, o, down = plan.qkv, plan.gate_up, _int8_single(plan.o), _int8_single(plan.down)
    if not (type(qkv) is Int8Pack and type(gate_up) is Int8Pack and o and down):
        return None
    products = []
    for (weight, scale, bias, in_perm), layers in (((qkv.weight, qkv.scale, qkv.bias, qkv.in_perm),
                                                    (plan.q, plan.k, plan.v)), (o, (plan.o,)),
                                                   ((gate_up.weight, gate_up.scale, gate_up.bias, gate_up.in_perm),
                                                    (plan.gate, plan.up)), (down, (plan.down,))):
        keep += [t for t in (weight, scale, bias) if t is not None]
        n = scale.numel()  # the codes are a flat h16 pack of [n, k]
        v16 = None
        if activations == "int8":  # the [n, k] codes are unpacked only when the pack is not made yet
            v16 = _v16_int8(weight, lambda layers=layers: torch.cat([m.int8_rows() for m in layers]), scale)
        if v16 is not None:
            *v16, group = v16
            keep.extend(v16)
            products.append(_Q4(*(t.data_ptr() for t in v16), _ptr(bias), n, weight.numel() // n, group, W8A8,
                                _perm_ptr(in_perm, keep)))
            continue
        products.append(_Q4(weight.data_ptr(), scale.data_ptr(), None, _ptr(bias), n, weight.numel() // n, 0, I8,
                            _perm_ptr(in_perm, keep)))
    return tuple(products)


def _half_products(plan, keep: list, dot: str = "fp32") -> tuple[_Q4, ...] | None:
    """A layer's structs where all four products are fp16 on fbgemm (the packs made from the same fp16 weights),
    else None. A draft's int8 activations do not apply: fp16 products stay fp32 (`ACTIVATIONS`). `dot="bf16"`: b16
    products instead of h16 (`DOTS`)."""
    # each pack kept on one module: q,k,v's on the attention module, gate,up's on the gate layer, o's and down's on
    # themselves
    products = (_half_product(plan.qkv, [plan.q, plan.k, plan.v], plan.attn, keep, dot),
                _half_product(None, [plan.o], plan.o, keep, dot),
                _half_product(plan.gate_up, [plan.gate, plan.up], plan.gate, keep, dot),
                _half_product(None, [plan.down], plan.down, keep, dot))
    return None if any(p is None for p in products) else products


def _head_pack(model, dot: str = "fp32") -> tuple | None:
    """(h16 pack, fp32 bias or None) of an fp16 output head on fbgemm, run on specquant's fp16 kernel after the
    stack (as fast as fbgemm at a row, faster at a verify pass's few: SmolLM2's 49152 x 576 head 1639 against
    1997 us at 5 rows, `python benchmarks/kernel_gemms.py half`), or None: the head runs itself. `dot="bf16"`: its b16
    pack (the stack's products and the head round alike)."""

    head = model.get_output_embeddings()
    if type(head) is not HalfStorageLinear or getattr(head, "fbgemm_fp16", None) is None:
        return None
    return _half_pack([head.weight], [head.bias], head, dot)


def _fp32(norm) -> torch.Tensor | None:
    w = norm.weight
    return w if w.dtype == torch.float32 and w.is_contiguous() else None


class NativeDecoder:
    """The C stack's view of a model's layers (built from the lean forward's layer plans, see `of`); `run` advances
    one sequence's hidden states through every layer in one call."""

    head: tuple | None = None  # (h16 pack, bias) of the output head (`_head_pack`), or None: the head runs itself
    head_kernel = half_native  # the head pack's kernel: half_native (h16) or bf16_native (b16, engine.native_dot=bf16)

    def __init__(self, layers: list, keep: list, dims: _Dims, max_rows: int, n_layers: int):
        self.layers = (_Layer * n_layers)(*layers)
        self._keep = keep  # tensors the C structs point into (fp32 bias copies), alive as long as this
        self._buffers = None  # ((cache id, buffer epoch), (keys, values) address arrays): `_addresses`
        self._kivi = native_kv.KIVIView()  # a KIVI cache's addresses and the new rows' scratch
        self.dims = dims
        self.n_layers = n_layers
        kinds = [q.kind for layer in layers for q in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        self.kinds = kinds
        # products with int8 activations: int4 or int8 weights on vnni_gemm.c (`of(..., activations="int8")`)
        self.w4a8 = sum(kinds.count(kind) for kind in INT8_ACTIVATIONS)
        self.half = kinds.count(H16) + kinds.count(B16)  # a float model's fp16 products (h16 or b16 kernel)
        # every product on int8 activations: a KIVI cache's codes are read in integers too (native_kv.py)
        self.int_scores = bool(kinds) and self.w4a8 == len(kinds)
        # the fp32 int4 GEMM loses to dequantize + F.linear from the packs' max_rows on; every other kernel wins at
        # any row count: w4a8/w8a8 (integer dot products), and fp16, bf16 and exact int8 against the torch path
        # (a 512-token SmolLM2 prompt: fp16 835 -> 623 ms, bf16 751 -> 437 ms, int8 953 -> 620 ms, and exact where
        # the torch path quantized an int8 layer's activations per row; docs/engine.md "Where a short prompt's time
        # goes"), so a stack without int4 fp32 products runs prompts up to W4A8_MAX_ROWS rows (the bound of its
        # per-call scratch: attention's partials, H x M x M/256 x (head_dim + 2) floats)
        self.runs_prompts = bool(kinds) and N8 not in kinds
        self.max_rows = W4A8_MAX_ROWS if self.runs_prompts else max_rows

    @classmethod
    def of(cls, model, plans, activations: str = "fp32", dot: str = "fp32") -> tuple[NativeDecoder | None, str]:
        """The native stack for `model`'s layer plans, or (None, why not). `activations="int8"` (a draft's stack):
        the products run the w4a8 kernel where it is available and its layout holds them (`ACTIVATIONS`, checked
        by `LeanForward.use_activations`). `dot="bf16"`: a float model's products and head on the bf16 dot-product
        kernel (`DOTS`; engine.native_dot)."""
        if library() is None:
            return None, "the native decoder did not build (no C compiler, no AVX2, or SPECQUANT_NO_KERNELS)"
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = getattr(model.model, "rotary_emb", None)
        if rotary is None or getattr(rotary, "inv_freq", None) is None or rotary.inv_freq.numel() * 2 != head_dim:
            return None, "partial or missing rotary embedding"
        if head_dim % 8 or head_dim > 512:
            return None, f"head_dim {head_dim} (needs a multiple of 8, at most 512)"
        layers, keep, max_rows = [], [], None
        for plan in plans:
            qkv, gate_up = plan.qkv, plan.gate_up
            if qkv is None or gate_up is None:
                return None, "no fused q,k,v / gate,up packs (engine.gemm=torch, or a swapped layer)"
            if len(qkv.sizes) != 3 or len(gate_up.sizes) != 2 or gate_up.sizes[0] != gate_up.sizes[1]:
                return None, "unexpected fused pack shapes"
            products = (_int4_products(plan, keep, activations) or _int8_products(plan, keep, activations)
                        or _half_products(plan, keep, dot))
            if products is None:
                if dot == "bf16":
                    return None, ("not every q,k,v / gate,up / o / down product is fp16 on fbgemm with specquant's "
                                  "bf16 kernel available (AVX512-BF16) and an input width divisible by 32 "
                                  "(engine.native_dot=bf16)")
                return None, ("not every q,k,v / gate,up / o / down product is int4 or int8 on specquant's kernels or "
                              "fp16 on fbgemm with specquant's fp16 kernel available (AVX2 + F16C)")
            if plan.act is not F.silu:
                return None, "an activation that is not SiLU"
            norms = _fp32(plan.input_norm), _fp32(plan.post_norm)
            if any(n is None for n in norms):
                return None, "norm weights not in fp32"
            layers.append(_Layer(norms[0].data_ptr(), norms[1].data_ptr(), *products))
            max_rows = min(qkv.max_rows, gate_up.max_rows, max_rows or qkv.max_rows)
            keep += [norms[0], norms[1]]
        attn = plans[0].attn
        heads = plans[0].qkv.sizes[0] // head_dim
        kv_heads = plans[0].qkv.sizes[1] // head_dim
        eps = plans[0].input_norm.variance_epsilon
        if any(p.input_norm.variance_epsilon != eps or p.post_norm.variance_epsilon != eps for p in plans):
            return None, "norms with different epsilons"
        dims = _Dims(config.hidden_size, heads, kv_heads, head_dim, plans[0].gate_up.sizes[0], 0, eps, attn.scaling)
        decoder = cls(layers, keep, dims, max_rows, len(plans))
        decoder.head = _head_pack(model, dot)
        decoder.head_kernel = _HALF[dot][0]
        return decoder, ""

    def describe(self) -> dict:
        """What runs this stack's products and head, by kernel, with the ISA level they were built for."""
        level = cpu.isa()
        amx = " on AMX tiles" if bf16_native.amx_in_use() else ""
        names = {N8: "int4 x fp32 (int4_gemm.c)", W4A8: f"int4 x int8 {vnni.isa_name()} (vnni_gemm.c)",
                 H16: "fp16 x fp32 (half_gemm.c)", I8: "int8 x fp32 (int8_gemm.c)", B16: f"bf16 dot{amx} (bf16_gemm.c)",
                 W8A8: f"int8 x int8 {vnni.isa_name()} (vnni_gemm.c)"}
        products: dict[str, int] = {}
        for kind in self.kinds:
            products[f"{names[kind]}, {level}"] = products.get(f"{names[kind]}, {level}", 0) + 1
        head = None
        if self.head is not None:
            head = (f"bf16 dot{amx} (bf16_gemm.c), {level}" if self.head_kernel is bf16_native
                    else f"fp16 x fp32 (half_gemm.c), {level}")
        out = {"decoder": f"native stack (decoder_layers.c), {level}", "products": products, "head": head}
        if self.int_scores and int_scores_built():
            out["quantized KV"] = f"keys' scores and values' sums in integers (attention.c int_query), {level}"
        return out

    def applies(self, hidden: torch.Tensor, attention_mask, cache) -> bool:
        """Whether this call can run natively (see the module docstring); cheap checks only."""

        batch, rows = hidden.shape[0], hidden.shape[1]
        if batch != 1 or rows >= self.max_rows or hidden.dtype != torch.float32 or cache is None:
            return False
        layers = getattr(cache, "layers", None)
        if not layers or len(layers) < self.n_layers:
            return False
        if attention_mask is not None and not bool(attention_mask.all()):
            return False
        if native_kv.reads(layers[0]):  # a KIVI cache holding the prompt: attention reads its codes
            return layers[0].length + rows <= layers[0].max_length
        if type(layers[0]) is not ContiguousKVLayer:
            return False
        first = layers[0]
        if not first.is_initialized:  # an empty cache: a w4a8 stack runs the prompt too (see __init__)
            return (self.runs_prompts and rows <= first.max_length
                    and first.storage_dtype(1, torch.float32) in KV_DTYPES)
        if (first.key_buffer.dtype not in KV_DTYPES or first.key_buffer.shape[0] != 1
                or not first.key_buffer.is_contiguous()):
            return False
        return first.length + rows <= first.max_length

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The output head over normed hidden states [B, M, d] on specquant's fp16 (or bf16) kernel where `head` is
        set (and the rows fp32), else None: the head module runs."""
        if self.head is None or hidden.dtype != torch.float32:
            return None
        packed, bias = self.head
        batch, rows, d = hidden.shape
        return self.head_kernel.linear(hidden.reshape(batch * rows, d), packed, packed.numel() // d, bias).view(
            batch, rows, -1)

    def _addresses(self, cache, layers) -> tuple:
        """The layers' key and value buffer addresses as C arrays, remade only when some buffer was (re)made
        (`ContiguousKVLayer.buffer_epoch`) or another cache comes: a draft step otherwise spends ~0.05 ms on them."""

        # the first and last buffers' addresses too: a later cache at a freed one's id, holding layers made before
        # the arrays were, cannot pass for it
        key = (id(cache), ContiguousKVLayer.buffer_epoch, layers[0].key_buffer.data_ptr(),
               layers[-1].value_buffer.data_ptr())
        if self._buffers is None or self._buffers[0] != key:
            keys = (ctypes.c_void_p * self.n_layers)(*(layer.key_buffer.data_ptr() for layer in layers))
            values = (ctypes.c_void_p * self.n_layers)(*(layer.value_buffer.data_ptr() for layer in layers))
            self._buffers = key, (keys, values)
        return self._buffers[1]

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        """hidden [1, M, d] fp32 (consumed: updated in place and returned) through every layer; cos, sin [M,
        head_dim] for the rows' positions. Writes the rows' keys and values at the cache's next slots and advances
        it."""
        layers = cache.layers[:self.n_layers]
        if type(layers[0]) is not ContiguousKVLayer:
            return self._run_kivi(hidden, cos, sin, cache, layers)
        if not layers[0].is_initialized:  # a prompt into an empty cache (`runs_prompts`): all layers are empty
            d = self.dims
            for layer in layers:
                layer.allocate(1, d.kv_heads, d.head_dim, d.head_dim, layer.storage_dtype(1, torch.float32),
                               hidden.device)
        start = layers[0].length
        if any(layer.length != start or type(layer) is not type(layers[0]) for layer in layers):
            raise RuntimeError("the KV cache's layers hold different lengths")
        keys, values = self._addresses(cache, layers)
        self.dims.cap = layers[0].max_length
        self.dims.kv_half = KV_DTYPES[layers[0].key_buffer.dtype]
        rows = hidden.shape[1]
        rc = library().sq_decoder_layers(ctypes.byref(self.layers), self.n_layers, ctypes.byref(self.dims),
                                         hidden.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(), keys, values, start)
        if rc:
            raise RuntimeError(f"the native decoder failed (rc {rc})")
        for layer in layers:
            layer.advance(rows)
        return hidden

    def _run_kivi(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, layers) -> torch.Tensor:
        """`run` over a KIVI cache (toolkit/engine/native_kv.py): the rows in the pieces the cache asks for
        (`read_splits`: each row reads the cache as a one-token step would), each piece's keys and values appended
        after its call."""
        rows, d = hidden.shape[1], self.dims
        edges = [0, *cache.read_splits(rows), rows]
        for a, b in zip(edges, edges[1:]):
            first = layers[0]
            if any(layer.length != first.length for layer in layers):  # one config: the same bounds at one length
                raise RuntimeError("the KV cache's layers hold different lengths")
            # where no token leaves the window, the stack writes the new ones straight behind it (a decode step
            # between flushes); else to a scratch, appended (and quantized) by the cache after the call
            in_place = first.in_window(b - a)
            structs, bounds = self._kivi.structs(cache, layers, b - a, d.kv_heads, d.head_dim, in_place,
                                                 self.int_scores)
            piece = hidden[0, a:b]
            rc = library().sq_decoder_layers_kvq(ctypes.byref(self.layers), self.n_layers, ctypes.byref(d),
                                                 piece.data_ptr(), b - a, cos[a:b].data_ptr(), sin[a:b].data_ptr(),
                                                 ctypes.byref(structs), ctypes.byref(bounds), first.length)
            if rc:
                raise RuntimeError(f"the native decoder failed (rc {rc})")
            if in_place:
                for layer in layers:
                    layer.grow_in_window(b - a)
            else:
                self._kivi.append(layers, b - a, d.kv_heads, d.head_dim)
        return hidden
