"""The lean forward's operators (`toolkit.engine.lean_forward`): attention (transformers' function for the model's
implementation, or `sdpa_gqa`; piece by piece where a quantized cache asks), rotary embeddings from a table with one
`roll`, RMSNorm as torch's one operator, and fp16-stored Linears' fbgemm products called directly. Each computes what
the transformers module or function it stands in for computes, bit for bit (tested)."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from toolkit.engine.precision import HalfStorageLinear

__all__ = ["apply_linear", "apply_norm", "attend_in_pieces", "attention_function", "rotary_cos_sin", "rotary_table",
           "rotate_rolled", "sdpa_gqa", "signed_sin"]


def sdpa_gqa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
             **_) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention (`sdpa_attention_forward`) as it runs here, except that a masked pass also
    shares each key/value head among its query heads (`enable_gqa`) instead of copying them (`repeat_kv`).

    Why: transformers copies the keys and values whenever a mask is given, because CUDA's fused kernels refuse a
    mask with grouped heads. On the CPU the fused kernel takes both; a speculative verify pass (several new tokens
    over a filled cache, so always masked) then skips two copies of the cache per layer. `python -m
    benchmarks.forward` times it. The results are bit-identical to transformers' when it is told to share heads
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


def attend_in_pieces(attention, attn, q, k, v, mask, cache, splits: list[int]) -> torch.Tensor:
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


def attention_function(config, device: torch.device, share_kv_heads: bool):
    name = config._attn_implementation
    if name == "sdpa" and device.type == "cpu" and share_kv_heads:
        return sdpa_gqa
    return ALL_ATTENTION_FUNCTIONS.get_interface(name, eager_attention_forward)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: then rotate_half(x) * sin == x.roll(half, -1) * signed_sin(sin) exactly
    (rotate_half(x) is cat(-x2, x1), the roll is cat(x2, x1), and -a * b == a * -b in IEEE arithmetic)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate_rolled(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # apply_rotary_pos_emb for one tensor (so that q and k side by side can turn in one pass), in 3 operators
    # instead of 7 (rotate_half is two slices, a negation and a concatenation)
    return (x * cos) + (x.roll(cos.shape[-1] // 2, -1) * signed_sin)


def apply_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """The RMSNorm module's output. In fp32 torch's one-operator rms_norm computes what the module's five do
    (x * rsqrt(mean(x^2) + eps), times the weight; bit-identical, tested), so it stands in for them; other dtypes
    keep the module's code, whose casts round where torch's operator does not."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return norm.forward(x)


def apply_linear(module, x: torch.Tensor, rows: int) -> torch.Tensor:
    """`module(x)`. An fp16-stored layer's fbgemm product (what HalfStorageLinear.forward picks for few fp32 rows)
    is called directly: the module call costs about a fifth of the product itself here."""
    if type(module) is HalfStorageLinear:
        y = module.bf16_product(x, rows)
        if y is None:
            y = module.fbgemm_product(x, rows)
        if y is not None:
            return y
    return module(x)


def rotary_cos_sin(rotary, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    table = rotary_table(rotary, hidden, int(high) + 1)
    return table[0][position_ids], table[1][position_ids]


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # rotary module -> its (cos, sin) table


def rotary_table(rotary, hidden: torch.Tensor, need: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain rotary's (cos, sin) table for positions 0..n-1, n >= `need` (`rotary_cos_sin`), made or grown (by
    doubling, at least 1024) when it is shorter or of another dtype than `hidden`, and kept on the module."""
    table = _TABLES.get(rotary)
    if table is None or table[0].shape[0] < need or table[0].dtype != hidden.dtype:
        size = max(1024, 1 << (need - 1).bit_length())
        cos, sin = rotary(hidden, position_ids=torch.arange(size, device=hidden.device)[None])
        table = (cos[0], sin[0])
        _TABLES[rotary] = table
    return table
