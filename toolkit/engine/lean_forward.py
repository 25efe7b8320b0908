"""A lean forward for Llama-shaped decoders: the same modules and the same arithmetic as transformers' forward,
without its per-call framework.

Why: on a model as small as SmolLM2-135M a decode step through transformers' forward spends much of its time in
Python around the operators: per-layer decorators and keyword plumbing, output-capture wrappers, config attribute
lookups and ~400 module calls per step. That overhead, not bytes, sets the decode speed there, and speculative
decoding's draft and verify passes pay it too. `python -m toolkit.bench.forward` times both forwards side by side.

What it is: transformers' `LlamaModel.forward` and `LlamaDecoderLayer.forward` written out as one loop over the
model's own modules (its Linear layers, whatever the engine swapped in: fbgemm fp16, QuantLinear; its norms'
`forward`; its rotary embedding; the KV cache's own `update`; transformers' causal-mask builder and the attention
function registered for the model's attention implementation: sdpa, eager, or the paged server's). The arithmetic
is the same numbers, so the logits are bit-identical to the transformers forward's (tested; fused projections below
are within fp32 rounding); only the framework around them is gone.

Fewer operators for the same numbers, each one exact (tested bit for bit against transformers' forward):
- fp32 norms run torch's one-operator `rms_norm`, which computes what LlamaRMSNorm's five operators compute;
- rotary embeddings turn q and k with one `roll` against a sin table whose first half is negated, in place of
  `rotate_half`'s two slices, negation and concatenation (-a * b == a * -b in IEEE arithmetic);
- fbgemm-packed o and down projections are called directly, and SiLU as `F.silu`, without module calls.
Each layer's modules are looked up once into a plan (`_LayerPlan`), kept until any module or parameter is
assigned anywhere (torch's global registration hooks) or packs are fused or dropped: a module swapped after
`install` is the one that runs (tested).

One exception, sdpa on the CPU (`sdpa_gqa`): a masked pass (a verify pass over a filled cache, a padded batch)
shares each key/value head among its query heads instead of copying it per query head as transformers does. Same
numbers, same kernel; bit-identical to transformers' forward told to share them (`TRANSFORMERS_SDPA_FORCE_GQA=1`),
within fp32 rounding of its default (tested). `python -m toolkit.bench.forward` times it against transformers' copies
(`LeanForward(share_kv_heads=False)`).

Fused projections (`fuse_projections`): with fp16 weights run by fbgemm (the engine default on x86), each layer's
q, k and v products become one fbgemm call and gate and up another: 4 calls a layer instead of 7. A 1-row fbgemm
call has a fixed cost that small layers (SmolLM2's k_proj is 192x576) never amortize; `python -m
toolkit.bench.forward` prints layer 0's fused and separate calls side by side. fbgemm may block the wider
product's sum differently, so fused results are the separate layers' within fp32 rounding (on SmolLM2's shapes,
bit-identical). The fused pack replaces the separate layers' packs (the memory stays what it was); those layers
keep their fp16 weights for the transformers forward and for products of FBGEMM_MAX_ROWS rows or more, which the
lean forward sends to them unfused. A pack is used only while the model holds the very layers it packed (a swapped
layer makes it stale). Int4 QuantLinear layers (a quantized checkpoint, the int4 self-draft) get the same two
packs, `Int4N8Pack` on specquant's int4 GEMM and `Int4Pack` on torch's int4 kernel: both layouts are blocked along
the output dim, so the stacked packs are the stacked weights' pack, bit-identical to the separate layers (checked
when made, and tested).

Native int4 decoder (`toolkit/engine/native_decoder.py`): where every layer's products are int4 on specquant's
kernel (a quantized checkpoint, the int4 self-draft), a call it can run (fp32, one sequence, the fp cache holding the
prompt, few rows) goes through the whole decoder stack in one C call instead of the loop below: within fp32
rounding of it, not bit-identical, but row-independent bit for bit. `LeanForward(native=False)` (engine.forward=lean)
keeps the loop.

Which models: `LlamaForCausalLM` (SmolLM2) and `Qwen2ForCausalLM` without sliding-window layers, under any
attention implementation but flash and flex attention. Anything else (Gemma 3's sliding windows, other
architectures) keep transformers' forward: `install` says which one a model runs (`engine.forward`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.activations import SiLUActivation
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaForCausalLM,
    LlamaRMSNorm,
    eager_attention_forward,
)
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM, Qwen2RMSNorm

from toolkit.engine.precision import (
    BF16_DEQUANT_MIN_ROWS,
    HalfStorageLinear,
    bf16_prompt_rows,
    prefill_runs_bf16,
)
from toolkit.errors import InputError

SUPPORTED = (LlamaForCausalLM, Qwen2ForCausalLM)
NORMS = (LlamaRMSNorm, Qwen2RMSNorm)  # weight * (x * rsqrt(mean(x^2) + eps)), computed in fp32
SILU = (SiLUActivation, torch.nn.SiLU)  # activations that are F.silu exactly

# Bumped whenever any module anywhere gets a submodule or parameter assigned (torch's global registration hooks),
# and when fused packs are made or dropped: a LeanForward's cached layer plan (`_LayerPlan`) is rebuilt when it
# changed, so a module swapped after `install` (a quantized layer, a self-draft's copy) is always the one that runs.
_GENERATION = [0]


def _bump(*_) -> None:
    _GENERATION[0] += 1


torch.nn.modules.module.register_module_module_registration_hook(_bump)
torch.nn.modules.module.register_module_parameter_registration_hook(_bump)


def unsupported_reason(model) -> str | None:
    """Why `model` cannot run the lean forward, or None when it can."""
    if type(model) not in SUPPORTED:
        return f"{type(model).__name__} is not one of {', '.join(c.__name__ for c in SUPPORTED)}"
    config = model.config
    if not _attention_supported(config):
        return f"attention implementation {config._attn_implementation!r} (flash and flex attention need arguments " \
               "the lean forward does not pass)"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return "sliding-window layers"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    inner = model.model
    norms = [inner.norm] + [n for layer in inner.layers
                            for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(type(n) not in NORMS for n in norms):
        return "a norm that is not the model's RMSNorm"
    return None


def _attention_supported(config) -> bool:
    # sdpa, eager and the paged server's sdpa take (module, q, k, v, mask, dropout, scaling, **what the cache passed)
    name = config._attn_implementation or "eager"
    return "flash" not in name and "flex" not in name


def sdpa_gqa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
             **_) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention (`sdpa_attention_forward`) as it runs here, except that a masked pass also
    shares each key/value head among its query heads (`enable_gqa`) instead of copying them (`repeat_kv`).

    Why: transformers copies the keys and values whenever a mask is given, because CUDA's fused kernels refuse a
    mask with grouped heads. On the CPU the fused kernel takes both; a speculative verify pass (several new tokens
    over a filled cache, so always masked) then skips two copies of the cache per layer. `python -m
    toolkit.bench.forward` times it. The results are bit-identical to transformers' when it is told to share heads
    too (`TRANSFORMERS_SDPA_FORCE_GQA=1`) and within fp32 rounding of its copying path (tested; on SmolLM2's shapes
    identical). Used on the CPU only, for the models' "sdpa" implementation."""
    q_length = query.shape[2]
    is_causal = q_length > 1 and attention_mask is None and getattr(module, "is_causal", True)
    if is_causal and key.shape[2] > q_length:  # as transformers: an empty static cache's prefill, the flash kernel
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
        enable_gqa=getattr(module, "num_key_value_groups", 1) > 1)
    return out.transpose(1, 2).contiguous(), None


def _attend_in_pieces(attention, attn, q, k, v, mask, cache, splits: list[int]) -> torch.Tensor:
    """Attention of a pass whose rows must read the cache as one-token steps would (`read_splits`): the cache is
    updated with each piece's keys and values in turn and the piece's rows attend over what that update returns,
    under their rows of the pass's causal mask. The products around attention still run the whole pass at once.
    Such a pass has cached tokens and several new ones, so transformers always builds its mask (it leaves it out
    only for one new token or an empty cache)."""
    past = cache.layers[attn.layer_idx].get_seq_length()
    edges = [0, *splits, q.shape[2]]
    outs = []
    for prev, a, b in zip([None, *edges], edges, edges[1:]):
        passed = {}
        # a later piece reads again only what the flush since the previous piece's read changed
        keys, values = cache.update(k[:, :, a:b], v[:, :, a:b], attn.layer_idx, kwargs=passed,
                                    continues_from=None if prev is None else past + prev)
        out, _ = attention(attn, q[:, :, a:b], keys, values, mask[:, :, a:b, :past + b], dropout=0.0,
                           scaling=attn.scaling, **passed)
        outs.append(out)
    return torch.cat(outs, dim=1)


def _attention_function(config, device: torch.device, share_kv_heads: bool):
    name = config._attn_implementation
    if name == "sdpa" and device.type == "cpu" and share_kv_heads:
        return sdpa_gqa
    return ALL_ATTENTION_FUNCTIONS.get_interface(name, eager_attention_forward)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: then rotate_half(x) * sin == x.roll(half, -1) * _signed_sin(sin) exactly
    (rotate_half(x) is cat(-x2, x1), the roll is cat(x2, x1), and -a * b == a * -b in IEEE arithmetic)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate_rolled(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # apply_rotary_pos_emb for one tensor (so that q and k side by side can turn in one pass), in 3 operators
    # instead of 7 (rotate_half is two slices, a negation and a concatenation)
    return (x * cos) + (x.roll(cos.shape[-1] // 2, -1) * signed_sin)


def _norm(norm, x: torch.Tensor) -> torch.Tensor:
    """The RMSNorm module's output. In fp32 torch's one-operator rms_norm computes what the module's five do
    (x * rsqrt(mean(x^2) + eps), times the weight; bit-identical, tested), so it stands in for them; other dtypes
    keep the module's code, whose casts round where torch's operator does not."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return norm.forward(x)


def _linear(module, x: torch.Tensor, rows: int) -> torch.Tensor:
    """`module(x)`. An fp16-stored layer's fbgemm product (what HalfStorageLinear.forward picks for few fp32 rows)
    is called directly: the module call costs about a fifth of the product itself here."""
    if type(module) is HalfStorageLinear:
        y = module.bf16_product(x, rows)
        if y is None:
            y = module.fbgemm_product(x, rows)
        if y is not None:
            return y
    return module(x)


def _split_outputs(pack, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A fused pack's product split back into its layers' outputs (every pack's `__call__`)."""
    return pack.run(x).split(pack.sizes, dim=-1)


def _gathered(x: torch.Tensor, in_perm: torch.Tensor | None) -> torch.Tensor:
    """x with its last dim in an act-order pack's column order (`QuantLinear.in_perm`), or x itself."""
    return x if in_perm is None else x.index_select(-1, in_perm)


def _on_rows(x: torch.Tensor, product) -> torch.Tensor:
    """`product` (a kernel taking fp32 rows [rows, in]) applied to x [..., in], in x's dtype and leading shape."""
    y = product(x.reshape(-1, x.shape[-1]))
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


class FusedPack(NamedTuple):
    """One fbgemm fp16 pack of several Linear layers' weights stacked along the output dim."""
    packed: torch.Tensor
    sizes: tuple[int, ...]  # each layer's out_features, in order
    max_rows: int  # fewer rows than this run the pack
    sources: tuple  # the layers packed: a pack is used only while the model still holds exactly these

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)

    __call__ = _split_outputs


class Int4Pack(NamedTuple):
    """One int4 packed weight (torch's CPU int4pack layout) of several QuantLinear layers stacked along the output
    dim, run as QuantLinear's kernel path runs each of them (bf16 activations, its group size, fp32 bias after)."""
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group: int
    bias: torch.Tensor | None
    sizes: tuple[int, ...]
    max_rows: int
    sources: tuple

    in_perm: torch.Tensor | None = None  # act-order layers: the input order their columns share

    def run(self, x: torch.Tensor) -> torch.Tensor:
        from toolkit.quant.qlinear import int4pack_mm

        x = _gathered(x, self.in_perm)
        rows = x.numel() // x.shape[-1]
        y = int4pack_mm(x.reshape(rows, x.shape[-1]), self.packed, self.group, self.scales_and_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    __call__ = _split_outputs


class Int4N8Pack(NamedTuple):
    """Several QuantLinear layers on specquant's int4 GEMM (``"int4n8"``, `toolkit.quant.int4_native`) stacked
    along the output dim: the n8 layout is block-major along it, so the stacked packs are the pack of the stacked
    weights. Runs as each layer's kernel path does (fp32 activations, bias in the kernel)."""
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group: int
    bias: torch.Tensor | None
    sizes: tuple[int, ...]
    max_rows: int
    sources: tuple

    in_perm: torch.Tensor | None = None  # act-order layers: the input order their columns share

    def run(self, x: torch.Tensor) -> torch.Tensor:
        from toolkit.quant import int4_native

        return _on_rows(_gathered(x, self.in_perm),
                        lambda x2: int4_native.linear(x2, self.codes, self.scale, self.zero, self.group, self.bias))

    __call__ = _split_outputs


class Int8Pack(NamedTuple):
    """Several int8 per-channel QuantLinear layers on specquant's int8 GEMM (`toolkit.quant.int8_native`) stacked along
    the output dim: per-channel codes and scales stack row by row, the codes packed again in the kernel's h16 order.
    Runs as each layer's kernel path does (fp32 activations, bias in the kernel); like the int4 packs it is a copy
    (1 byte per weight of q,k,v and gate,up), and a decode step reads only it."""
    weight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]
    max_rows: int
    sources: tuple

    in_perm: torch.Tensor | None = None  # act-order layers: the input order their columns share

    def run(self, x: torch.Tensor) -> torch.Tensor:
        from toolkit.quant import int8_native

        return _on_rows(_gathered(x, self.in_perm),
                        lambda x2: int8_native.linear(x2, self.weight, self.scale, self.bias))

    __call__ = _split_outputs


def _stacked_bias(modules) -> torch.Tensor | None:
    """The layers' fp32 biases stacked along the output dim (zeros for a layer without one), or None if none has one."""
    if all(m.bias is None for m in modules):
        return None
    return torch.cat([(m.bias.float() if m.bias is not None else torch.zeros(m.out_features)) for m in modules])


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
    from toolkit.quant.qlinear import QuantLinear

    first = modules[0]
    if not all(type(m) is QuantLinear and m.kernel == "int4n8" and not hasattr(m, "g_idx")
               and m.in_features == first.in_features
               and m.group_size == first.group_size and m.kernel_max_rows == first.kernel_max_rows
               and m.weight_int4n8.device.type == "cpu" and _same_in_perm(m, first) for m in modules):
        return None
    return _checked(Int4N8Pack(torch.cat([m.weight_int4n8 for m in modules]), torch.cat([m.scale for m in modules]),
                               torch.cat([m.zero for m in modules]), first.group_size, _stacked_bias(modules),
                               tuple(m.out_features for m in modules), first.kernel_max_rows, tuple(modules),
                               first.in_perm),
                    modules)


def on_int8_gemm(module) -> bool:
    """Whether `module` is an int8 per-channel QuantLinear on specquant's int8 GEMM (what Int8Pack and the native
    decoder's int8 products take)."""
    from toolkit.quant.qlinear import QuantLinear

    return type(module) is QuantLinear and module.kernel == "int8pack" and module.int8_native


def _fuse_int8(modules) -> Int8Pack | None:
    """An Int8Pack of int8 QuantLinear layers on specquant's int8 GEMM with one input width, or None."""
    from toolkit.quant import int8_native

    first = modules[0]
    if not all(on_int8_gemm(m) and m.in_features == first.in_features and m.kernel_max_rows == first.kernel_max_rows
               and m.weight_int8_h16.device.type == "cpu" and _same_in_perm(m, first) for m in modules):
        return None
    return _checked(Int8Pack(int8_native.pack(torch.cat([m.int8_rows() for m in modules])),
                             torch.cat([m.scale for m in modules]).contiguous(), _stacked_bias(modules),
                             tuple(m.out_features for m in modules), first.kernel_max_rows, tuple(modules),
                             first.in_perm),
                    modules)


def _fuse_int4(modules) -> Int4Pack | Int4N8Pack | None:
    """An Int4Pack of QuantLinear layers that run torch's int4 kernel on the same input width and group (an
    Int4N8Pack of layers on specquant's int4 GEMM, `_fuse_int4n8`), or None.
    The packed layout is blocked along the output dim, so stacking the layers' packs is the pack of their stacked
    weights; a trial product against the separate layers confirms it (bit for bit) before the pack is used. Unlike
    fbgemm's, the layers keep their own packs (their dequantize path for wide products reads them): the fused copy
    adds half a byte per weight of q,k,v and gate,up, and a decode step reads only the fused one."""
    from toolkit.quant.qlinear import QuantLinear

    if all(type(m) is QuantLinear and m.kernel == "int4n8" for m in modules):
        return _fuse_int4n8(modules)
    first = modules[0]
    if not all(type(m) is QuantLinear and m.kernel == "int4pack" and m._code_layout == "packed"
               and not hasattr(m, "g_idx") and m.kernel_in == m.in_features == first.in_features
               and m.kernel_group_size == first.kernel_group_size and m.kernel_max_rows == first.kernel_max_rows
               and m.weight_int4pack.device.type == "cpu" and _same_in_perm(m, first) for m in modules):
        return None
    return _checked(Int4Pack(torch.cat([m.weight_int4pack for m in modules]),
                             torch.cat([m.scales_and_zeros for m in modules], dim=1).contiguous(),
                             first.kernel_group_size, _stacked_bias(modules), tuple(m.out_features for m in modules),
                             first.kernel_max_rows, tuple(modules), first.in_perm), modules)


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
    return FusedPack(packed, tuple(m.out_features for m in modules), modules[0].fbgemm_max_rows, tuple(modules))


def fuse_projections(model) -> int:
    """Give each decoder layer of a lean-supported model fused q,k,v and gate,up packs, fbgemm fp16 (see the module
    docstring), int8 (`Int8Pack`) or int4 (`Int4Pack`, `Int4N8Pack`); returns how many packs were made (0 where the
    layers are none of these)."""
    made = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(attn, "specquant_qkv", None) is None:
            attn.specquant_qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            made += attn.specquant_qkv is not None
        if getattr(mlp, "specquant_gate_up", None) is None:
            mlp.specquant_gate_up = _fuse([mlp.gate_proj, mlp.up_proj])
            made += mlp.specquant_gate_up is not None
    _bump()
    return made


def _pack(module, name: str, *layers) -> FusedPack | Int4Pack | Int4N8Pack | Int8Pack | None:
    """`module`'s fused pack of `layers`, or None. A layer swapped since the pack was made (a self-draft's quantized
    copy) makes it stale: then the layers run themselves. fbgemm computes in fp32, so exact_linears (an fp16
    overflow's rerun) keeps a fused pack, as it keeps the separate layers' packs."""
    pack = getattr(module, name, None)
    if pack is None or any(a is not b for a, b in zip(pack.sources, layers)):
        return None
    return pack


def _pack_for(pack, rows: int, bf16: bool):
    """The fused pack a product of `rows` rows runs on, or None (the layers run themselves): a pack serves fewer
    rows than its `max_rows`. In a bf16 prompt pass fp16 packs give way to their layers' bf16 products, int4 packs
    from BF16_DEQUANT_MIN_ROWS rows (their layers' bf16 dequantize path); int8 packs keep their exact kernel."""
    if pack is None or rows >= pack.max_rows:
        return None
    if bf16 and (type(pack) is FusedPack or (type(pack) is not Int8Pack and rows >= BF16_DEQUANT_MIN_ROWS)):
        return None
    return pack


class _LayerPlan(NamedTuple):
    """What one decoder layer runs, looked up once (module attribute lookups cost more than some of the operators
    they feed on a model this small) and reused until a module is swapped (`_GENERATION`)."""
    attn: torch.nn.Module
    input_norm: torch.nn.Module
    qkv: FusedPack | Int4Pack | Int4N8Pack | Int8Pack | None
    q: torch.nn.Module
    k: torch.nn.Module
    v: torch.nn.Module
    o: torch.nn.Module
    post_norm: torch.nn.Module
    gate_up: FusedPack | Int4Pack | Int4N8Pack | Int8Pack | None
    gate: torch.nn.Module
    up: torch.nn.Module
    act: object  # F.silu where the module is exactly that (no module call), else the activation module
    down: torch.nn.Module

    @classmethod
    def of(cls, layer) -> _LayerPlan:
        attn, mlp = layer.self_attn, layer.mlp
        return cls(attn, layer.input_layernorm, _pack(attn, "specquant_qkv", attn.q_proj, attn.k_proj, attn.v_proj),
                   attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.post_attention_layernorm,
                   _pack(mlp, "specquant_gate_up", mlp.gate_proj, mlp.up_proj), mlp.gate_proj, mlp.up_proj,
                   F.silu if type(mlp.act_fn) in SILU else mlp.act_fn, mlp.down_proj)


def strip_fused(module) -> None:
    """Drop the fused packs under `module` (a copy whose layers are about to be swapped: they would be stale)."""
    for child in module.modules():
        child.__dict__.pop("specquant_qkv", None)
        child.__dict__.pop("specquant_gate_up", None)
    _bump()


def _rotary(rotary, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary module's cos, sin for `position_ids`, as rows of a table it made once for positions 0..n-1 (n
    grown by doubling), for the plain rotary ("default" rope type, CPU): its forward is elementwise in the position
    (position * inv_freq, then cos and sin), so a row of the table is bit for bit what a call for that position
    returns (tested), and a decode step indexes two rows instead of running ~8 small operators (~0.07 ms a call,
    paid by every drafted token). Any other rope type, or device, or a negative position calls the module."""
    if getattr(rotary, "rope_type", None) != "default" or hidden.device.type != "cpu" or not position_ids.numel():
        return rotary(hidden, position_ids=position_ids)
    low, high = torch.aminmax(position_ids)
    if int(low) < 0:  # an index would wrap around the table: no such position is ever asked of it
        return rotary(hidden, position_ids=position_ids)
    table = _rotary_table(rotary, hidden, int(high) + 1)
    return table[0][position_ids], table[1][position_ids]


def _rotary_table(rotary, hidden: torch.Tensor, need: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain rotary's (cos, sin) table for positions 0..n-1, n >= `need` (`_rotary`), made or grown (by
    doubling, at least 1024) when it is shorter or of another dtype than `hidden`, and kept on the module."""
    table = getattr(rotary, "specquant_table", None)
    if table is None or table[0].shape[0] < need or table[0].dtype != hidden.dtype:
        size = max(1024, 1 << (need - 1).bit_length())
        cos, sin = rotary(hidden, position_ids=torch.arange(size, device=hidden.device)[None])
        table = (cos[0], sin[0])
        rotary.specquant_table = table
    return table


def one_token_forward(model):
    """The model's installed `LeanForward` when its one-token path (`LeanForward.one_token`) may apply, else None;
    `one_token` itself still returns None where the native stack cannot run a call. Both one-token callers (the
    engine's decode step, a speculative `RaggedBatch`) ask here."""
    lean = model.__dict__.get("forward")
    return lean if hasattr(lean, "one_token") and lean.takes_read_splits() else None


class LeanForward:
    """Stands in for the model's `forward` (see `install`): input_ids, attention_mask, position_ids, an explicit
    `cache`, logits_to_keep. Any other request (inputs_embeds, labels, hidden states, no cache with use_cache), and
    any call after the attention implementation changed to flash or flex attention, goes to transformers' forward.
    Its layer plan is rebuilt after any module swap, so later swaps (a self-draft's cut) are seen."""

    def __init__(self, model, share_kv_heads: bool = True, native: bool = True):
        self.model = model
        self.share_kv_heads = share_kv_heads  # sdpa on the CPU: sdpa_gqa (False: transformers' sdpa, for comparison)
        self.native = native  # int4 stacks run the native decoder where a call allows (toolkit/engine/native_decoder)
        self.native_activations = "fp32"  # "int8": its products on the w4a8 kernel (a draft's; `use_activations`)
        self.native_dot = "fp32"  # "bf16": a float model's products on the bf16 dot-product kernel (`use_dot`)
        self._plan: tuple[tuple, list[_LayerPlan]] | None = None  # (what it was built for, the layers' plans)
        self._native = None  # the NativeDecoder of the current plan, or None
        self.native_reason = ""  # why the current plan has none

    def plan(self) -> list[_LayerPlan]:
        """The decoder layers' plans, rebuilt when a module was swapped or the layer count changed (and with them
        the native decoder's view of the layers)."""
        inner = self.model.model
        key = (_GENERATION[0], inner.config.num_hidden_layers)
        if self._plan is None or self._plan[0] != key:
            # list(), not a slice: slicing a ModuleList builds a new one, registering modules (a bump of its own)
            self._plan = key, [_LayerPlan.of(layer) for layer in list(inner.layers)[:inner.config.num_hidden_layers]]
            self._native, self.native_reason = None, "engine.forward=lean"
            if self.native:
                from toolkit.engine.native_decoder import NativeDecoder

                self._native, self.native_reason = NativeDecoder.of(self.model, self._plan[1],
                                                                    self.native_activations, self.native_dot)
        return self._plan[1]

    def use_activations(self, activations: str) -> None:
        """The native decoder's activations from now on: "fp32" (exact) or "int8" (the w4a8 kernel, for drafts)."""
        from toolkit.engine.native_decoder import ACTIVATIONS

        if activations not in ACTIVATIONS:
            raise ValueError(f"native decoder activations must be one of {ACTIVATIONS}, got {activations!r}")
        self.native_activations = activations
        self._plan = None

    def use_dot(self, dot: str) -> None:
        """A float model's native products from now on: "fp32" (fp16 weights x fp32 activations, the engine's
        default) or "bf16" (weights and activations rounded to bf16, fp32 sums: `toolkit.quant.bf16_native`)."""
        from toolkit.engine.native_decoder import DOTS

        if dot not in DOTS:
            raise ValueError(f"native decoder products must be one of {DOTS}, got {dot!r}")
        self.native_dot = dot
        self._plan = None

    def native_decoder(self):
        """The native decoder for the model's current layers, or None (`native_reason` says why)."""
        self.plan()
        return self._native

    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, cache=None, use_cache: bool | None = None,
                 logits_to_keep: int = 0, **kwargs):
        if "past_key_values" in kwargs and cache is None:
            cache = kwargs.pop("past_key_values")
        if (input_ids is None or any(v is not None and v is not False for v in kwargs.values())
                or (cache is None and use_cache is not False) or not isinstance(logits_to_keep, int)
                or self.model.training or not _attention_supported(self.model.config)):
            return type(self.model).forward(self.model, input_ids=input_ids, attention_mask=attention_mask,
                                            position_ids=position_ids, cache=cache, use_cache=use_cache,
                                            logits_to_keep=logits_to_keep, **kwargs)
        return CausalLMOutputWithPast(logits=self.logits(input_ids, attention_mask, position_ids, cache,
                                                         logits_to_keep), cache=cache)

    def one_token(self, token: int, position: int, cache) -> torch.Tensor | None:
        """`logits` for one token of one sequence at `position` [1, 1, vocab] where the native stack runs the call,
        else None (the caller takes the general call). The same arithmetic as `logits` on that call -- the
        embedding's row cast as the embedding's output is, the rotary table's rows, the stack, the head -- without
        the tensors and operators that a call builds around it: a drafted token's step runs them just after the
        stack has streamed the weights through the caches, so each costs tens of microseconds there (~0.5 ms a
        SmolLM2 draft step, docs/notes/2026-12-runtime-kernels-native-decoder.md "The draft step's own costs")."""
        native = self.native_decoder()
        weight = self._plain_embedding()
        rotary = self.model.model.rotary_emb
        if (native is None or weight is None or getattr(rotary, "rope_type", None) != "default" or position < 0
                or not 0 <= token < weight.shape[0]):
            return None
        hidden = weight[token:token + 1].to(torch.float32, copy=True)[None]  # [1, 1, d], consumed by `run`
        if not native.applies(hidden, None, cache):
            return None
        table = _rotary_table(rotary, hidden, position + 1)
        native.run(hidden, table[0][position:position + 1], table[1][position:position + 1], cache)
        return self._head(hidden, 1, native)

    def _plain_embedding(self) -> torch.Tensor | None:
        """The embedding's weight where its output is that weight's rows cast to fp32 (a plain nn.Embedding on the
        CPU whose only hook is the engine's cast, engine/precision.py), else None."""
        embed = self.model.model.embed_tokens
        hooks = list(embed._forward_hooks.values())
        if (type(embed) is not torch.nn.Embedding or embed.max_norm is not None or embed._forward_pre_hooks
                or embed.weight.device.type != "cpu" or embed.weight.dtype not in (torch.float32, torch.float16,
                                                                                  torch.bfloat16)
                or len(hooks) > 1 or (hooks and getattr(hooks[0], "casts_to", None) is not torch.float32)
                or (not hooks and embed.weight.dtype is not torch.float32)):
            return None
        return embed.weight

    def takes_read_splits(self) -> bool:
        """Whether calls take the lean path, which updates and attends piece by piece where the cache asks
        (`read_splits`); otherwise the caller has to run the pieces as separate forwards (spec/ragged.py)."""
        return not self.model.training and _attention_supported(self.model.config)

    def logits(self, input_ids, attention_mask, position_ids, cache, logits_to_keep: int) -> torch.Tensor:
        model = self.model
        inner = model.model
        config = inner.config
        hidden = inner.embed_tokens(input_ids)
        batch, length = input_ids.shape
        rows = batch * length
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(length, device=hidden.device)[None] + past
        cos, sin = _rotary(inner.rotary_emb, hidden, position_ids)
        native = self.native_decoder()
        # a prompt pass in bf16 (HalfStorageLinear.bf16_product, QuantLinear.prefill_bf16) runs layer by layer, the
        # fp16-stored layers' products unfused
        bf16 = bf16_prompt_rows(rows) and prefill_runs_bf16(model)
        if native is not None and not bf16 and native.applies(hidden, attention_mask, cache):
            hidden = native.run(hidden, cos[0].contiguous(), sin[0].contiguous(), cache)
            return self._head(hidden, logits_to_keep, native)
        mask = create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache,
                                  position_ids=position_ids)
        # a quantized cache under a verify pass: rows read it piece by piece (KV cache `read_splits`)
        splits = cache.read_splits(length) if cache is not None and hasattr(cache, "read_splits") else []
        cos, sin = cos.unsqueeze(1), _signed_sin(sin.unsqueeze(1))
        attention = _attention_function(config, hidden.device, self.share_kv_heads)
        for plan in self.plan():
            attn = plan.attn
            x = _norm(plan.input_norm, hidden)  # the norm's own arithmetic, without a module call
            shape = (batch, length, -1, attn.head_dim)
            qkv = _pack_for(plan.qkv, rows, bf16)
            if qkv is not None:  # q and k sit side by side in the fused output: rotate them in one pass
                out = qkv.run(x)
                heads = qkv.sizes[0] // attn.head_dim
                qk = _rotate_rolled(out[..., :qkv.sizes[0] + qkv.sizes[1]].view(shape).transpose(1, 2), cos, sin)
                q, k = qk[:, :heads], qk[:, heads:]
                v = out[..., qkv.sizes[0] + qkv.sizes[1]:]
            else:
                q = _rotate_rolled(_linear(plan.q, x, rows).view(shape).transpose(1, 2), cos, sin)
                k = _rotate_rolled(_linear(plan.k, x, rows).view(shape).transpose(1, 2), cos, sin)
                v = _linear(plan.v, x, rows)
            v = v.view(shape).transpose(1, 2)
            if splits:
                out = _attend_in_pieces(attention, attn, q, k, v, mask, cache, splits)
            else:
                passed = {}  # what the cache hands the attention call (the paged cache's plan), as transformers does
                if cache is not None:
                    k, v = cache.update(k, v, attn.layer_idx, kwargs=passed)
                out, _ = attention(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, **passed)
            hidden = hidden + _linear(plan.o, out.reshape(batch, length, -1).contiguous(), rows)
            x = _norm(plan.post_norm, hidden)
            gate_up = _pack_for(plan.gate_up, rows, bf16)
            if gate_up is not None:
                gate, up = gate_up(x)
            else:
                gate, up = _linear(plan.gate, x, rows), _linear(plan.up, x, rows)
            hidden = hidden + _linear(plan.down, plan.act(gate) * up, rows)
        return self._head(hidden, logits_to_keep)

    def _head(self, hidden: torch.Tensor, logits_to_keep: int, native=None) -> torch.Tensor:
        """The final norm and the output head over the last `logits_to_keep` rows (0: all); after the native stack,
        its own run of the head where it has one (`NativeDecoder.head_logits`)."""
        if logits_to_keep:  # the norm is per row: only the kept rows need it
            hidden = hidden[:, -logits_to_keep:, :]
        hidden = _norm(self.model.model.norm, hidden)  # the module's arithmetic without its five operators
        logits = native.head_logits(hidden) if native is not None else None
        return self.model.lm_head(hidden) if logits is None else logits


FORWARDS = ("auto", "native", "lean", "transformers")


def install(model, choice: str = "auto") -> str:
    """Make `model`'s forward the lean one where it applies; returns which forward the model now runs: "native"
    (the lean forward whose int4 decoder stack runs in one C call where a call allows,
    toolkit/engine/native_decoder.py), "lean" or "transformers". `choice`: auto (the fastest that applies), native
    or lean (an error where it does not apply), transformers (leave the model as it is)."""
    if choice not in FORWARDS:
        raise InputError(f"unknown engine.forward {choice!r}", f"use one of {', '.join(FORWARDS)}")
    if choice == "transformers":
        return "transformers"
    reason = unsupported_reason(model)
    if reason:
        if choice in ("lean", "native"):
            raise InputError(f"engine.forward={choice} cannot run this model: {reason}",
                             "use engine.forward=auto (or transformers), which keeps transformers' forward here")
        return "transformers"
    fuse_projections(model)
    forward = LeanForward(model, native=choice != "lean")
    model.forward = forward
    if forward.native_decoder() is not None:
        return "native"
    if choice == "native":
        raise InputError(f"engine.forward=native cannot run this model: {forward.native_reason}",
                         "use engine.forward=auto, which runs the lean forward's torch operators here")
    return "lean"


def rebind(copy_of_model) -> None:
    """After `copy.copy(model)` (a self-draft sharing the target's modules): a lean forward copied with the instance
    still runs the original's layers; give the copy its own."""
    forward = copy_of_model.__dict__.get("forward")
    if isinstance(forward, LeanForward):
        fuse_projections(copy_of_model)  # its own layers (a self-draft's int4 copies) get packs of their own
        copy_of_model.forward = LeanForward(copy_of_model, forward.share_kv_heads, forward.native)
        copy_of_model.forward.native_dot = forward.native_dot  # shared float layers (the head) keep one pack
