"""A lean forward for Llama-shaped decoders: the same modules and the same arithmetic as transformers' forward,
without its per-call framework.

Why: on a model as small as SmolLM2-135M a decode step through transformers' forward spends much of its time in
Python around the operators: per-layer decorators and keyword plumbing, output-capture wrappers, config attribute
lookups and ~400 module calls per step. That overhead, not bytes, sets the decode speed there, and speculative
decoding's draft and verify passes pay it too. `python -m benchmarks.forward` times both forwards side by side.

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
- fbgemm-packed o and down projections are called directly, and SiLU as `F.silu`, without module calls
(these operators: `toolkit/engine/lean_ops.py`).
Each layer's modules are looked up once into a plan (`_LayerPlan`), kept until any module or parameter is
assigned anywhere (torch's global registration hooks) or packs are fused or dropped: a module swapped after
`install` is the one that runs (tested).

One exception, sdpa on the CPU (`sdpa_gqa`): a masked pass (a verify pass over a filled cache, a padded batch)
shares each key/value head among its query heads instead of copying it per query head as transformers does. Same
numbers, same kernel; bit-identical to transformers' forward told to share them (`TRANSFORMERS_SDPA_FORCE_GQA=1`),
within fp32 rounding of its default (tested). `python -m benchmarks.forward` times it against transformers' copies
(`LeanForward(share_kv_heads=False)`).

Fused projections (`toolkit/engine/fused_packs.py`): each layer's q,k,v products run as one kernel call and gate,up
as another (fbgemm fp16, int8 or int4 packs), 4 calls a layer instead of 7; fp16 packs within fp32 rounding of the
separate layers, int packs bit-identical.

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
from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM, Qwen2RMSNorm

from toolkit.engine.fused_packs import (
    FusedPack,
    Int4N8Pack,
    Int4Pack,
    Int8Pack,
    fuse_projections,
    layer_pack,
    pack_for,
)
from toolkit.engine.lean_ops import (
    apply_linear,
    apply_norm,
    attend_in_pieces,
    attention_function,
    rotary_cos_sin,
    rotary_table,
    rotate_rolled,
    signed_sin,
)
from toolkit.engine.module_swaps import GENERATION
from toolkit.engine.native_decoder import ACTIVATIONS, DOTS, NativeDecoder
from toolkit.engine.precision import bf16_prompt_rows, prefill_runs_bf16
from toolkit.errors import InputError

SUPPORTED = (LlamaForCausalLM, Qwen2ForCausalLM)
NORMS = (LlamaRMSNorm, Qwen2RMSNorm)  # weight * (x * rsqrt(mean(x^2) + eps)), computed in fp32
SILU = (SiLUActivation, torch.nn.SiLU)  # activations that are F.silu exactly


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


class _LayerPlan(NamedTuple):
    """What one decoder layer runs, looked up once (module attribute lookups cost more than some of the operators
    they feed on a model this small) and reused until a module is swapped (`module_swaps.GENERATION`)."""
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
        return cls(attn, layer.input_layernorm,
                   layer_pack(attn, "qkv", attn.q_proj, attn.k_proj, attn.v_proj), attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.post_attention_layernorm,
                   layer_pack(mlp, "gate_up", mlp.gate_proj, mlp.up_proj), mlp.gate_proj, mlp.up_proj,
                   F.silu if type(mlp.act_fn) in SILU else mlp.act_fn, mlp.down_proj)



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
        key = (GENERATION[0], inner.config.num_hidden_layers)
        if self._plan is None or self._plan[0] != key:
            # list(), not a slice: slicing a ModuleList builds a new one, registering modules (a bump of its own)
            self._plan = key, [_LayerPlan.of(layer) for layer in list(inner.layers)[:inner.config.num_hidden_layers]]
            self._native, self.native_reason = None, "engine.forward=lean"
            if self.native:

                self._native, self.native_reason = NativeDecoder.of(self.model, self._plan[1],
                                                                    self.native_activations, self.native_dot)
        return self._plan[1]

    def use_activations(self, activations: str) -> None:
        """The native decoder's activations from now on: "fp32" (exact) or "int8" (the w4a8 kernel, for drafts)."""

        if activations not in ACTIVATIONS:
            raise ValueError(f"native decoder activations must be one of {ACTIVATIONS}, got {activations!r}")
        self.native_activations = activations
        self._plan = None

    def use_dot(self, dot: str) -> None:
        """A float model's native products from now on: "fp32" (fp16 weights x fp32 activations, the engine's
        default) or "bf16" (weights and activations rounded to bf16, fp32 sums: `toolkit.quant.bf16_native`)."""

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
        table = rotary_table(rotary, hidden, position + 1)
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
        if position_ids is None:  # the tokens seen so far, with any a windowed cache dropped
            past = getattr(cache, "position", cache.get_seq_length()) if cache is not None else 0
            position_ids = torch.arange(length, device=hidden.device)[None] + past
        cos, sin = rotary_cos_sin(inner.rotary_emb, hidden, position_ids)
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
        cos, sin = cos.unsqueeze(1), signed_sin(sin.unsqueeze(1))
        attention = attention_function(config, hidden.device, self.share_kv_heads)
        for plan in self.plan():
            attn = plan.attn
            x = apply_norm(plan.input_norm, hidden)  # the norm's own arithmetic, without a module call
            shape = (batch, length, -1, attn.head_dim)
            qkv = pack_for(plan.qkv, rows, bf16)
            if qkv is not None:  # q and k sit side by side in the fused output: rotate them in one pass
                out = qkv.run(x)
                heads = qkv.sizes[0] // attn.head_dim
                qk = rotate_rolled(out[..., :qkv.sizes[0] + qkv.sizes[1]].view(shape).transpose(1, 2), cos, sin)
                q, k = qk[:, :heads], qk[:, heads:]
                v = out[..., qkv.sizes[0] + qkv.sizes[1]:]
            else:
                q = rotate_rolled(apply_linear(plan.q, x, rows).view(shape).transpose(1, 2), cos, sin)
                k = rotate_rolled(apply_linear(plan.k, x, rows).view(shape).transpose(1, 2), cos, sin)
                v = apply_linear(plan.v, x, rows)
            v = v.view(shape).transpose(1, 2)
            if splits:
                out = attend_in_pieces(attention, attn, q, k, v, mask, cache, splits)
            else:
                passed = {}  # what the cache hands the attention call (the paged cache's plan), as transformers does
                if cache is not None:
                    k, v = cache.update(k, v, attn.layer_idx, kwargs=passed)
                out, _ = attention(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, **passed)
            hidden = hidden + apply_linear(plan.o, out.reshape(batch, length, -1).contiguous(), rows)
            x = apply_norm(plan.post_norm, hidden)
            gate_up = pack_for(plan.gate_up, rows, bf16)
            if gate_up is not None:
                gate, up = gate_up(x)
            else:
                gate, up = apply_linear(plan.gate, x, rows), apply_linear(plan.up, x, rows)
            hidden = hidden + apply_linear(plan.down, plan.act(gate) * up, rows)
        return self._head(hidden, logits_to_keep)

    def _head(self, hidden: torch.Tensor, logits_to_keep: int, native=None) -> torch.Tensor:
        """The final norm and the output head over the last `logits_to_keep` rows (0: all); after the native stack,
        its own run of the head where it has one (`NativeDecoder.head_logits`)."""
        if logits_to_keep:  # the norm is per row: only the kept rows need it
            hidden = hidden[:, -logits_to_keep:, :]
        hidden = apply_norm(self.model.model.norm, hidden)  # the module's arithmetic without its five operators
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
