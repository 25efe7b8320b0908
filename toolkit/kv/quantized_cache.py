"""A KIVI-style quantized KV cache that transformers' attention writes into, croppable exactly.

Layout per layer (batch B, kv heads H, head dim D, group G, residual R):
  * quantized part, the first Tq = cfg.flushed_tokens(length) tokens (a multiple of G):
      keys   codes [B, H, T, D*bits/8] + fp16 scale/min [B, H, T/G, 1, D]  (per channel over G tokens)
      values codes [B, H, T, D*bits/8] + fp16 scale/min [B, H, T, D/Gv, 1] (per token over Gv = min(G, D) channels)
    (hierarchical INT8: codes as two packed 4-bit planes, hi and lo; same bytes as INT8.)
  * a full-precision residual of the remaining R <= n < R + G tokens (fewer when the whole cache holds < R + G);
    whenever it reaches R + G tokens its oldest whole groups are quantized (flushed).
  * with crop_shadow, a full-precision copy of the most recently flushed group.

Why the shadow: the state is a function of the length alone (see `KVQuantConfig.flushed_tokens`), so cropping to
below `Tq + R` must un-flush the last group back into full precision, exactly as a cache built fresh at that length
holds it. Dequantize-requantize cannot give back the original values; the shadow can. One group covers any crop of
up to G tokens below the highest flush point (a speculative rollback is a few tokens); a crop that would need an
older group raises instead of silently diverging. Its G tokens are counted in `nbytes`; without it
(`kv.crop_shadow=false`) crops inside the full-precision part still work and deeper ones raise.

What attention gets: the quantized part dequantized, then the residual and the new tokens in full precision, i.e.
tokens are read back quantized only from the step after they were flushed (as KIVI and transformers'
QuantizedCache do). `dequant="cached"` keeps a dequantized float copy updated only when groups flush: same values,
but it holds a float copy of the whole cache, which defeats the purpose; it exists to measure against.
"""

import torch
from transformers.cache_utils import CacheLayerMixin

from toolkit.engine.kv_cache import LayeredKVCache
from toolkit.errors import InputError
from toolkit.kv.config import KVQuantConfig
from toolkit.kv.quantize import (
    dequantize_groups,
    dequantize_hi,
    join_planes,
    pack,
    quantize_groups,
    split_planes,
    unpack,
)


class QuantizedKVLayer(CacheLayerMixin):
    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, max_length: int, cfg: KVQuantConfig):
        super().__init__()
        self.cfg = cfg
        self.max_length = max_length
        self.length = 0  # tokens held
        self.quantized = 0  # of which quantized (a multiple of the group size)
        self.shadow_valid = False

    # ---- storage -------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cfg = self.cfg
        B, H, _, D = key_states.shape
        if value_states.shape[-1] != D:
            raise InputError("keys and values of different head dims", "use kv=fp for this model")
        self.value_group = min(cfg.group_size, D)
        if D % self.value_group or D * cfg.bits % 8:
            raise InputError(f"head dim {D} is not a multiple of kv.group_size={cfg.group_size}",
                             "use kv.group_size dividing the head dim, or kv=fp")
        self.dtype, self.device = key_states.dtype, key_states.device
        G, T = cfg.group_size, self.max_length // cfg.group_size * cfg.group_size
        u8, f16 = dict(dtype=torch.uint8, device=self.device), dict(dtype=torch.float16, device=self.device)
        fp = dict(dtype=self.dtype, device=self.device)
        planes = (2, D // 2) if cfg.hierarchical else (1, D * cfg.bits // 8)
        self.k_codes = [torch.empty(B, H, T, planes[1], **u8) for _ in range(planes[0])]
        self.v_codes = [torch.empty(B, H, T, planes[1], **u8) for _ in range(planes[0])]
        self.k_scale = torch.empty(B, H, T // G, 1, D, **f16)
        self.k_min = torch.empty_like(self.k_scale)
        self.v_scale = torch.empty(B, H, T, D // self.value_group, 1, **f16)
        self.v_min = torch.empty_like(self.v_scale)
        self.k_res = torch.empty(B, H, cfg.residual + G, D, **fp)
        self.v_res = torch.empty_like(self.k_res)
        if cfg.crop_shadow:
            self.k_shadow = torch.empty(B, H, G, D, **fp)
            self.v_shadow = torch.empty_like(self.k_shadow)
        if cfg.dequant == "cached":
            self.k_float = torch.empty(B, H, self.max_length, D, **fp)
            self.v_float = torch.empty_like(self.k_float)
            self.float_synced = 0  # quantized tokens already written dequantized into the float copy
        self.is_initialized = True

    def _store(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize whole groups k, v [B, H, n*G, D] into positions start.. of the quantized part."""
        cfg, G = self.cfg, self.cfg.group_size
        B, H, n, D = k.shape
        kc, ks, km = quantize_groups(k.view(B, H, n // G, G, D), cfg.bits, dim=-2)
        vc, vs, vm = quantize_groups(v.view(B, H, n, D // self.value_group, self.value_group), cfg.bits, dim=-1)
        self.k_scale[:, :, start // G:(start + n) // G] = ks
        self.k_min[:, :, start // G:(start + n) // G] = km
        self.v_scale[:, :, start:start + n] = vs
        self.v_min[:, :, start:start + n] = vm
        for codes, dest in ((kc.view(B, H, n, D), self.k_codes), (vc.view(B, H, n, D), self.v_codes)):
            planes = split_planes(codes) if cfg.hierarchical else (pack(codes, cfg.bits),)
            for plane, buf in zip(planes, dest):
                buf[:, :, start:start + n] = plane

    def _codes(self, planes: list[torch.Tensor], end: int, hi_only: bool) -> torch.Tensor:
        if hi_only:
            return unpack(planes[0][:, :, :end], 4)
        if self.cfg.hierarchical:
            return join_planes(planes[0][:, :, :end], planes[1][:, :, :end])
        return unpack(planes[0][:, :, :end], self.cfg.bits)

    def dequantize(self, start: int = 0, end: int | None = None, hi_only: bool = False):
        """Keys and values [B, H, end-start, D] of the quantized part (group-aligned range) in the cache dtype;
        `hi_only`: the INT4 reading of hierarchical codes."""
        G = self.cfg.group_size
        end = self.quantized if end is None else end
        kc = self._codes(self.k_codes, end, hi_only)[:, :, start:]
        vc = self._codes(self.v_codes, end, hi_only)[:, :, start:]
        B, H, n, D = kc.shape
        deq = dequantize_hi if hi_only else dequantize_groups
        k = deq(kc.view(B, H, n // G, G, D), self.k_scale[:, :, start // G:end // G],
                self.k_min[:, :, start // G:end // G], self.dtype).view(B, H, n, D)
        vg = self.value_group
        v = deq(vc.view(B, H, n, D // vg, vg), self.v_scale[:, :, start:end], self.v_min[:, :, start:end],
                self.dtype).view(B, H, n, D)
        return k, v

    # ---- the Cache layer interface --------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, hi_only: bool = False, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        if self.length + t > self.max_length:
            raise RuntimeError(f"KV cache overflow: {self.length + t} tokens > max_length {self.max_length}")
        n_res = self.length - self.quantized
        keys, values = self._read(key_states, value_states, n_res, hi_only)
        self._append(key_states, value_states, n_res)
        return keys, values

    def _read(self, k_new, v_new, n_res, hi_only):
        """What attention sees for this step: the quantized part dequantized, the residual, the new tokens."""
        if self.cfg.dequant == "cached" and not hi_only:
            if self.float_synced < self.quantized:
                k, v = self.dequantize(self.float_synced, self.quantized)
                self.k_float[:, :, self.float_synced:self.quantized] = k
                self.v_float[:, :, self.float_synced:self.quantized] = v
                self.float_synced = self.quantized
            end, t = self.length, k_new.shape[-2]
            self.k_float[:, :, end:end + t] = k_new
            self.v_float[:, :, end:end + t] = v_new
            return self.k_float[:, :, :end + t], self.v_float[:, :, :end + t]
        parts_k, parts_v = [k_new], [v_new]
        if n_res:
            parts_k.insert(0, self.k_res[:, :, :n_res])
            parts_v.insert(0, self.v_res[:, :, :n_res])
        if self.quantized:
            k, v = self.dequantize(hi_only=hi_only)
            parts_k.insert(0, k)
            parts_v.insert(0, v)
        if len(parts_k) == 1:
            return k_new, v_new
        return torch.cat(parts_k, dim=-2), torch.cat(parts_v, dim=-2)

    def _append(self, k_new, v_new, n_res):
        new_length = self.length + k_new.shape[-2]
        flush = self.cfg.flushed_tokens(new_length) - self.quantized
        if flush == 0:
            self.k_res[:, :, n_res:n_res + k_new.shape[-2]] = k_new
            self.v_res[:, :, n_res:n_res + k_new.shape[-2]] = v_new
        else:
            k_all = torch.cat([self.k_res[:, :, :n_res], k_new], dim=-2)
            v_all = torch.cat([self.v_res[:, :, :n_res], v_new], dim=-2)
            self._store(self.quantized, k_all[:, :, :flush], v_all[:, :, :flush])
            if self.cfg.crop_shadow:
                G = self.cfg.group_size
                self.k_shadow.copy_(k_all[:, :, flush - G:flush])
                self.v_shadow.copy_(v_all[:, :, flush - G:flush])
                self.shadow_valid = True
            rest = k_all.shape[-2] - flush
            self.k_res[:, :, :rest] = k_all[:, :, flush:]
            self.v_res[:, :, :rest] = v_all[:, :, flush:]
            self.quantized += flush
        self.length = new_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_length

    @torch.inference_mode()  # the buffers are inference tensors when the engine made them; writable only here
    def crop(self, length: int) -> None:
        """Keep the first `length` tokens (negative: remove that many), leaving the state a cache built fresh at
        that length would hold (see the module docstring)."""
        new_length = self.length + length if length < 0 else length
        if not 0 <= new_length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} tokens to {new_length}")
        new_quantized = self.cfg.flushed_tokens(new_length)
        if new_quantized < self.quantized and new_length > new_quantized:
            # un-flush: tokens [new_quantized, new_length) must come back in full precision, from the shadow
            G = self.cfg.group_size
            if not (self.shadow_valid and new_quantized == self.quantized - G):
                raise InputError(
                    f"cannot crop the quantized KV cache from {self.length} to {new_length} tokens exactly: that "
                    f"needs the full-precision values of tokens {new_quantized}..{self.quantized}, and only the "
                    f"last flushed group is kept" + ("" if self.cfg.crop_shadow else " (kv.crop_shadow=false)"),
                    "crop at most kv.group_size tokens below the last flush (or rebuild the cache), or raise "
                    "kv.residual so rollbacks stay in the full-precision window")
            m = max(0, new_length - self.quantized)  # residual tokens that survive, after the shadow's G
            self.k_res[:, :, G:G + m] = self.k_res[:, :, :m].clone()
            self.v_res[:, :, G:G + m] = self.v_res[:, :, :m].clone()
            self.k_res[:, :, :G] = self.k_shadow
            self.v_res[:, :, :G] = self.v_shadow
        if new_quantized < self.quantized:
            self.shadow_valid = False  # it held the group just un-flushed or dropped; the one before is not kept
        if self.cfg.dequant == "cached" and self.is_initialized:
            self.float_synced = min(self.float_synced, new_quantized)
            n = new_length - new_quantized
            self.k_float[:, :, new_quantized:new_length] = self.k_res[:, :, :n]
            self.v_float[:, :, new_quantized:new_length] = self.v_res[:, :, :n]
        self.quantized = min(self.quantized, new_quantized)
        self.length = new_length

    def reset(self) -> None:
        self.crop(0)

    _BATCHED = ("k_scale", "k_min", "v_scale", "v_min", "k_res", "v_res", "k_shadow", "v_shadow", "k_float",
                "v_float")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows of the batch picked (and repeated) by `beam_idx`, in every per-row buffer: codes, scales, minima,
        residual, shadow and float copy (beam search's reorder; evaluation's one context, several endings)."""
        if not self.is_initialized:
            return
        idx = beam_idx.to(self.device)
        self.k_codes = [c.index_select(0, idx) for c in self.k_codes]
        self.v_codes = [c.index_select(0, idx) for c in self.v_codes]
        for name in self._BATCHED:
            if hasattr(self, name):
                setattr(self, name, getattr(self, name).index_select(0, idx))

    # ---- bytes --------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the state a cache of this length holds: codes and scales/minima of the quantized groups, the
        full-precision residual tokens, the shadow group (once one was flushed), the float copy if cached."""
        if not self.is_initialized:
            return 0
        T, G = self.quantized, self.cfg.group_size

        def rows(t: torch.Tensor, n: int) -> int:
            return t[:, :, :1].numel() * t.element_size() * n

        total = sum(rows(c, T) for c in self.k_codes + self.v_codes)
        total += rows(self.k_scale, T // G) * 2 + rows(self.v_scale, T) * 2
        total += rows(self.k_res, self.length - T) * 2
        if self.cfg.crop_shadow and self.quantized:
            total += rows(self.k_shadow, G) * 2
        if self.cfg.dequant == "cached":
            total += rows(self.k_float, self.length) * 2
        return total


class QuantizedKVCache(LayeredKVCache):
    """A quantized KV cache for `num_layers` layers and up to `max_length` tokens per sequence (see the module
    docstring); the engine's interface: transformers' `Cache` plus `crop`, `length`, `nbytes`."""

    def __init__(self, num_layers: int, max_length: int, cfg: KVQuantConfig):
        super().__init__(layers=[QuantizedKVLayer(max_length, cfg) for _ in range(num_layers)])
        self.max_length = max_length
        self.cfg = cfg

    @classmethod
    def for_model(cls, model, max_length: int, cfg: KVQuantConfig) -> "QuantizedKVCache":
        config = model.config.get_text_config(decoder=True)
        return cls(config.num_hidden_layers, max_length, cfg)
