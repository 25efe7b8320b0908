"""A KIVI-style quantized KV cache that transformers' attention writes into, croppable exactly.

Layout per layer (batch B, kv heads H, head dim D, group G, residual R, rollback S):
  * keys: the first Tk = cfg.flushed_tokens(length) tokens (a multiple of G) quantized per channel over G tokens:
      codes [B, H, T, D*bits/8] + fp16 scale/min [B, H, T/G, 1, D]; the remaining R <= n < R + G tokens in full
      precision (fewer while the cache holds < R + G). Keys need G tokens before a group can be quantized.
  * values: the first Tv = cfg.flushed_values(length) tokens quantized per token over Gv = min(G, D) channels:
      codes [B, H, T, D*bits/8] + fp16 scale/min [B, H, T, D/Gv, 1]; the last R to R + 7 tokens in full precision
      (values need no group to fill: they are quantized as they leave the window, as in KIVI, 8 at a time).
    (hierarchical INT8: codes as two packed 4-bit planes, hi and lo; same bytes as INT8.)
  * with crop_shadow, full-precision shadows so that a crop of up to S = cfg.rollback tokens is exact: the last
    flushed key group while a crop that deep could still reach below it (until length >= Tk + R + S), and the
    originals of the last S + 7 flushed value tokens (a crop of S can un-flush one chunk of 8 more).
  * the first cfg.sink tokens' keys and values (attention sinks: BOS draws attention from every later token, and its
    key is unlike the rest of its group) also kept in full precision, and read back instead of their codes.
  * with cfg.pre_rope, keys are quantized un-rotated and rotated back when read (toolkit/kv/rope.py); with
    cfg.value_clip each value group's range is searched for the least error (toolkit/kv/quantize.py).

Why the shadows: the state is a function of the length alone (`flushed_tokens`, `flushed_values`), so cropping
must un-flush what a cache built fresh at the shorter length holds in full precision: the last key group and the
last values. Dequantize-requantize cannot give back the original values; the shadows can. They cover a
speculative rollback: a crop of at most kv.rollback tokens (default 17: a verify pass of the largest default spec
k_max 16, + 1) and at most what was appended since the last crop. A crop that would need originals no longer kept
raises instead of silently diverging. Their bytes are counted in `nbytes`; without them
(`kv.crop_shadow=false`) crops that stay inside the full-precision parts still work and deeper ones raise.

What attention gets: the quantized parts dequantized, then the full-precision tokens and the new ones, i.e. tokens
are read back quantized only from the step after they were flushed (as KIVI and transformers' QuantizedCache do).
They are assembled in one `Workspace` shared by the cache's layers (codes unpacked straight into floats, scaled in
place, the full-precision tokens written behind them: no concatenation), so what `update` returns is valid until
the next `update` of any layer of the cache. `dequant="cached"` keeps a dequantized float copy updated only when
tokens flush: same values, but it holds a float copy of the whole cache, which defeats the purpose; it exists to
measure against.
"""

import torch
from transformers.cache_utils import CacheLayerMixin

from toolkit.engine.kv_cache import LayeredKVCache
from toolkit.errors import InputError
from toolkit.kv.config import VALUE_FLUSH, KVQuantConfig
from toolkit.kv.quantize import CLIP_GRID, pack, quantize_groups, split_planes, unpack, unpack_into
from toolkit.kv.rope import RotaryTable, rope_frequencies, rotary_tables


class QuantizedKVLayer(CacheLayerMixin):
    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, max_length: int, cfg: KVQuantConfig, workspace: "Workspace | None" = None,
                 rope: RotaryTable | None = None):
        super().__init__()
        if cfg.pre_rope and rope is None:
            raise InputError("kv.pre_rope=true needs the model's rotary frequencies",
                             "build the cache with QuantizedKVCache.for_model, or set kv.pre_rope=false")
        self.cfg = cfg
        self.rope = rope
        self.workspace = workspace or Workspace()
        self.max_length = max_length
        self.length = 0  # tokens held
        self.quantized = 0  # keys quantized (a multiple of the group size)
        self.v_quantized = 0  # values quantized (length - residual once the cache is longer than that)
        self.shadow_valid = False  # k_shadow holds the originals of key group [quantized - G, quantized)
        self.v_shadow_n = 0  # v_shadow's last v_shadow_n rows hold the originals of values [v_quantized - n, ..)

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
        G, T, V = cfg.group_size, self.max_length // cfg.group_size * cfg.group_size, self.max_length
        u8, f16 = dict(dtype=torch.uint8, device=self.device), dict(dtype=torch.float16, device=self.device)
        fp = dict(dtype=self.dtype, device=self.device)
        planes = (2, D // 2) if cfg.hierarchical else (1, D * cfg.bits // 8)
        self.k_codes = [torch.empty(B, H, T, planes[1], **u8) for _ in range(planes[0])]
        self.v_codes = [torch.empty(B, H, V, planes[1], **u8) for _ in range(planes[0])]
        self.k_scale = torch.empty(B, H, T // G, 1, D, **f16)
        self.k_min = torch.empty_like(self.k_scale)
        self.v_scale = torch.empty(B, H, V, D // self.value_group, 1, **f16)
        self.v_min = torch.empty_like(self.v_scale)
        self.k_res = torch.empty(B, H, cfg.residual + G, D, **fp)
        self.v_res = torch.empty(B, H, cfg.residual + VALUE_FLUSH, D, **fp)
        if cfg.sink:
            self.k_sink = torch.empty(B, H, cfg.sink, D, **fp)
            self.v_sink = torch.empty_like(self.k_sink)
        if cfg.crop_shadow:
            self.k_shadow = torch.empty(B, H, G, D, **fp)
            self.v_shadow = torch.empty(B, H, cfg.value_shadow, D, **fp)
        if cfg.dequant == "cached":
            self.k_float = torch.empty(B, H, self.max_length, D, **fp)
            self.v_float = torch.empty_like(self.k_float)
            self.k_synced = self.v_synced = 0  # quantized tokens already written dequantized into the float copy
        self.is_initialized = True

    def _put(self, codes: torch.Tensor, dest: list[torch.Tensor], start: int) -> None:
        planes = split_planes(codes) if self.cfg.hierarchical else (pack(codes, self.cfg.bits),)
        for plane, buf in zip(planes, dest):
            buf[:, :, start:start + codes.shape[2]] = plane

    def _store_keys(self, start: int, k: torch.Tensor) -> None:
        """Quantize whole key groups k [B, H, n*G, D] into positions start.. of the quantized keys."""
        G = self.cfg.group_size
        B, H, n, D = k.shape
        if self.cfg.pre_rope:
            k = self.rope.rotate_(k.to(torch.float32, copy=True), start, inverse=True)
        kc, ks, km = quantize_groups(k.view(B, H, n // G, G, D), self.cfg.bits, dim=-2)
        self.k_scale[:, :, start // G:(start + n) // G] = ks
        self.k_min[:, :, start // G:(start + n) // G] = km
        self._put(kc.view(B, H, n, D), self.k_codes, start)

    def _store_values(self, start: int, v: torch.Tensor) -> None:
        """Quantize value tokens v [B, H, n, D] (each on its own) into positions start.. of the quantized values."""
        B, H, n, D = v.shape
        vg = self.value_group
        vc, vs, vm = quantize_groups(v.view(B, H, n, D // vg, vg), self.cfg.bits, dim=-1,
                                     clip_grid=CLIP_GRID if self.cfg.value_clip else None)
        self.v_scale[:, :, start:start + n] = vs
        self.v_min[:, :, start:start + n] = vm
        self._put(vc.view(B, H, n, D), self.v_codes, start)

    def _dequantize_into(self, out: torch.Tensor, planes: list[torch.Tensor], scale: torch.Tensor, mn: torch.Tensor,
                         span: tuple[int, int], grouped: tuple[int, ...], hi_only: bool,
                         sink: torch.Tensor | None, rotate: bool = False) -> torch.Tensor:
        """codes * scale + min written into `out` [B, H, n, D] (fp32 arithmetic, then the cache dtype), the codes of
        positions `span` viewed as [B, H, *grouped] to meet their scales; rotated back (pre-RoPE keys) and the sink
        tokens in the span replaced by their originals. The codes are unpacked straight into the output and scaled
        in place: no uint8 -> float copy, no concatenation after."""
        work = out if out.dtype == torch.float32 else torch.empty(out.shape, device=out.device)
        start, end = span
        if hi_only:  # the INT4 reading of hierarchical codes: the bucket centre 16 * hi + 7.5
            unpack_into(planes[0][:, :, start:end], 4, work).mul_(16).add_(7.5)
        elif self.cfg.hierarchical:  # 16 * hi + lo
            unpack_into(planes[0][:, :, start:end], 4, work).mul_(16).add_(unpack(planes[1][:, :, start:end], 4))
        else:
            unpack_into(planes[0][:, :, start:end], self.cfg.bits, work)
        work.view(*work.shape[:2], *grouped).mul_(scale.float()).add_(mn.float())
        if rotate:
            self.rope.rotate_(work, start)
        out = out if work is out else out.copy_(work)
        if sink is not None and start < self.cfg.sink:
            n = min(self.cfg.sink, end) - start
            out[:, :, :n] = sink[:, :, start:start + n]
        return out

    def dequantize_keys(self, start: int = 0, end: int | None = None, hi_only: bool = False,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """Keys [B, H, end-start, D] of the quantized part (a group-aligned range) in the cache dtype, into `out`
        when given; `hi_only`: the INT4 reading of hierarchical codes."""
        G = self.cfg.group_size
        end = self.quantized if end is None else end
        if out is None:
            B, H, _, D = self.k_res.shape
            out = torch.empty(B, H, end - start, D, dtype=self.dtype, device=self.device)
        D = out.shape[-1]
        return self._dequantize_into(out, self.k_codes, self.k_scale[:, :, start // G:end // G],
                                     self.k_min[:, :, start // G:end // G], (start, end), ((end - start) // G, G, D),
                                     hi_only, getattr(self, "k_sink", None), rotate=self.cfg.pre_rope)

    def dequantize_values(self, start: int = 0, end: int | None = None, hi_only: bool = False,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        end = self.v_quantized if end is None else end
        if out is None:
            B, H, _, D = self.k_res.shape
            out = torch.empty(B, H, end - start, D, dtype=self.dtype, device=self.device)
        D, vg = out.shape[-1], self.value_group
        return self._dequantize_into(out, self.v_codes, self.v_scale[:, :, start:end], self.v_min[:, :, start:end],
                                     (start, end), (end - start, D // vg, vg), hi_only, getattr(self, "v_sink", None))

    # ---- the Cache layer interface --------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, hi_only: bool = False, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        if self.length + t > self.max_length:
            raise RuntimeError(f"KV cache overflow: {self.length + t} tokens > max_length {self.max_length}")
        keys, values = self._read(key_states, value_states, hi_only)
        self._append(key_states, value_states)
        return keys, values

    def _read(self, k_new, v_new, hi_only):
        """What attention sees for this step: the quantized parts dequantized, the full-precision tokens, the new."""
        if self.cfg.dequant == "cached" and not hi_only:
            if self.k_synced < self.quantized:
                self.k_float[:, :, self.k_synced:self.quantized] = self.dequantize_keys(self.k_synced)
                self.k_synced = self.quantized
            if self.v_synced < self.v_quantized:
                self.v_float[:, :, self.v_synced:self.v_quantized] = self.dequantize_values(self.v_synced)
                self.v_synced = self.v_quantized
            end, t = self.length, k_new.shape[-2]
            self.k_float[:, :, end:end + t] = k_new
            self.v_float[:, :, end:end + t] = v_new
            return self.k_float[:, :, :end + t], self.v_float[:, :, :end + t]
        if self.length == 0:
            return k_new, v_new
        k_ws, v_ws = self.workspace.get(k_new, self.max_length)
        keys = self._assemble(k_ws, self.quantized, self.k_res, k_new)
        values = self._assemble(v_ws, self.v_quantized, self.v_res, v_new)
        if self.quantized:
            self.dequantize_keys(hi_only=hi_only, out=k_ws[:, :, :self.quantized])
        if self.v_quantized:
            self.dequantize_values(hi_only=hi_only, out=v_ws[:, :, :self.v_quantized])
        return keys, values

    def _assemble(self, ws: torch.Tensor, quantized: int, res: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """The full-precision tokens and the new ones behind where the quantized part will be dequantized."""
        end = self.length + new.shape[-2]
        ws[:, :, quantized:self.length] = res[:, :, :self.length - quantized]
        ws[:, :, self.length:end] = new
        return ws[:, :, :end]

    def _append(self, k_new, v_new):
        new_length = self.length + k_new.shape[-2]
        cfg = self.cfg
        if self.length < cfg.sink:  # the first tokens' originals, read back once they are quantized
            n = min(cfg.sink, new_length) - self.length
            self.k_sink[:, :, self.length:self.length + n] = k_new[:, :, :n]
            self.v_sink[:, :, self.length:self.length + n] = v_new[:, :, :n]
        # keys: whole groups, once they are R tokens old
        flushed = self._advance(self.k_res, self.quantized, k_new, cfg.flushed_tokens(new_length))
        if flushed is not None:
            self._store_keys(self.quantized, flushed)
            if cfg.crop_shadow:
                self.k_shadow.copy_(flushed[:, :, -cfg.group_size:])
                self.shadow_valid = True
            self.quantized += flushed.shape[-2]
        # values: every token once it leaves the last R (VALUE_FLUSH at a time)
        flushed = self._advance(self.v_res, self.v_quantized, v_new, cfg.flushed_values(new_length))
        if flushed is not None:
            self._store_values(self.v_quantized, flushed)
            if cfg.value_shadow:
                self._push_value_shadow(flushed)
            self.v_quantized += flushed.shape[-2]
        self.length = new_length
        self._expire_key_shadow()

    def _advance(self, res: torch.Tensor, quantized: int, new: torch.Tensor, target: int) -> torch.Tensor | None:
        """Append `new` behind the full-precision tokens `res` holds (those from `quantized` on); when `target`
        tokens should now be quantized, drop the oldest `target - quantized` from `res` and return them (originals,
        to be quantized by the caller), else None."""
        held, flush = self.length - quantized, target - quantized
        if flush == 0:
            res[:, :, held:held + new.shape[-2]] = new
            return None
        joined = torch.cat([res[:, :, :held], new], dim=-2)
        res[:, :, :joined.shape[-2] - flush] = joined[:, :, flush:]
        return joined[:, :, :flush]

    def _push_value_shadow(self, flushed: torch.Tensor) -> None:
        """Keep the originals of the last S flushed values at the end of v_shadow."""
        S, n = self.cfg.value_shadow, flushed.shape[-2]
        if n >= S:
            self.v_shadow.copy_(flushed[:, :, n - S:])
        else:
            self.v_shadow[:, :, :S - n] = self.v_shadow[:, :, n:].clone()
            self.v_shadow[:, :, S - n:] = flushed
        self.v_shadow_n = min(S, self.v_shadow_n + n)

    def _expire_key_shadow(self) -> None:
        # a crop of at most `rollback` tokens un-flushes the last key group only while length < Tk + R + rollback
        cfg = self.cfg
        if self.shadow_valid and self.length >= self.quantized + cfg.residual + cfg.rollback:
            self.shadow_valid = False

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_length

    def _cannot_crop(self, new_length: int, what: str) -> InputError:
        return InputError(
            f"cannot crop the quantized KV cache from {self.length} to {new_length} tokens exactly: that needs the "
            f"full-precision {what}, and only the last kv.rollback={self.cfg.rollback} tokens' worth is kept"
            + ("" if self.cfg.crop_shadow else " (kv.crop_shadow=false: none is kept)"),
            "crop at most kv.rollback tokens at a time (or rebuild the cache), or raise kv.rollback, or raise "
            "kv.residual so rollbacks stay in the full-precision window")

    @torch.inference_mode()  # the buffers are inference tensors when the engine made them; writable only here
    def crop(self, length: int) -> None:
        """Keep the first `length` tokens (negative: remove that many), leaving the state a cache built fresh at
        that length would hold (see the module docstring)."""
        new_length = self.length + length if length < 0 else length
        if not 0 <= new_length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} tokens to {new_length}")
        cfg, G = self.cfg, self.cfg.group_size
        new_k, new_v = cfg.flushed_tokens(new_length), cfg.flushed_values(new_length)
        k_back = new_k < self.quantized and new_length > new_k  # key group to bring back into full precision
        v_back = self.v_quantized - new_v if new_v < self.v_quantized and new_length > new_v else 0
        if k_back and not (self.shadow_valid and new_k == self.quantized - G):
            raise self._cannot_crop(new_length, f"keys of tokens {new_k}..{self.quantized}")
        if v_back > self.v_shadow_n:
            raise self._cannot_crop(new_length, f"values of tokens {new_v}..{self.v_quantized}")
        if k_back:  # the shadow's G tokens, then the residual keys that survive
            m = max(0, new_length - self.quantized)
            self.k_res[:, :, G:G + m] = self.k_res[:, :, :m].clone()
            self.k_res[:, :, :G] = self.k_shadow
        if new_k < self.quantized:
            self.shadow_valid = False  # it held the group just un-flushed or dropped; the one before is not kept
        if v_back:  # the last v_back shadow rows are values [new_v, v_quantized): those below new_length come back
            S, m = cfg.value_shadow, max(0, new_length - self.v_quantized)
            back = min(v_back, new_length - new_v)
            self.v_res[:, :, back:back + m] = self.v_res[:, :, :m].clone()
            self.v_res[:, :, :back] = self.v_shadow[:, :, S - v_back:S - v_back + back]
            self.v_shadow[:, :, v_back:] = self.v_shadow[:, :, :S - v_back].clone()
            self.v_shadow_n -= v_back
        elif new_v < self.v_quantized:  # cropped below every value the shadow held
            self.v_shadow_n = 0
        if cfg.dequant == "cached" and self.is_initialized:
            self.k_synced, self.v_synced = min(self.k_synced, new_k), min(self.v_synced, new_v)
            self.k_float[:, :, new_k:new_length] = self.k_res[:, :, :new_length - new_k]
            self.v_float[:, :, new_v:new_length] = self.v_res[:, :, :new_length - new_v]
        self.quantized, self.v_quantized = min(self.quantized, new_k), min(self.v_quantized, new_v)
        self.length = new_length
        self._expire_key_shadow()

    def reset(self) -> None:
        self.crop(0)

    _BATCHED = ("k_scale", "k_min", "v_scale", "v_min", "k_res", "v_res", "k_shadow", "v_shadow", "k_sink", "v_sink",
                "k_float", "v_float")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows of the batch picked (and repeated) by `beam_idx`, in every per-row buffer: codes, scales, minima,
        residuals, shadows and float copy (beam search's reorder; evaluation's one context, several endings)."""
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
        """Bytes of the state a cache of this length holds: codes and scales/minima of the quantized keys and
        values, the full-precision tokens, the shadows while they are held, the sink tokens' originals once they
        are quantized, the float copy if cached (not the rotary table of pre_rope: one per model, not per sequence)."""
        if not self.is_initialized:
            return 0
        Tk, Tv, G = self.quantized, self.v_quantized, self.cfg.group_size

        def rows(t: torch.Tensor, n: int) -> int:
            return t[:, :, :1].numel() * t.element_size() * n

        total = sum(rows(c, Tk) for c in self.k_codes) + sum(rows(c, Tv) for c in self.v_codes)
        total += rows(self.k_scale, Tk // G) * 2 + rows(self.v_scale, Tv) * 2
        total += rows(self.k_res, self.length - Tk) + rows(self.v_res, self.length - Tv)
        if self.cfg.sink:
            total += rows(self.k_sink, min(self.cfg.sink, Tk)) + rows(self.v_sink, min(self.cfg.sink, Tv))
        if self.cfg.crop_shadow:  # what a cache of this length holds (a crop may have used up part of it)
            R, S = self.cfg.residual, self.cfg.rollback
            if Tk and self.length < Tk + R + S:
                total += rows(self.k_shadow, G)
            total += rows(self.v_shadow, min(self.cfg.value_shadow, Tv))
        if self.cfg.dequant == "cached":
            total += rows(self.k_float, self.length) * 2
        return total


class Workspace:
    """Where attention's float keys/values are assembled (quantized part dequantized, full-precision tokens, new
    tokens), shared by every layer of a cache: one layer's worth of float keys and values at the longest length,
    not a float copy of the whole cache. What `update` returns is a view of it, valid until the next `update` of
    any layer of the same cache (attention consumes it first, as the paged cache's gather does)."""

    def __init__(self):
        self.keys = self.values = None

    def get(self, like: torch.Tensor, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, _, D = like.shape
        shape = (B, H, max_length, D)
        if self.keys is None or self.keys.shape != shape or self.keys.dtype != like.dtype:
            self.keys = torch.empty(shape, dtype=like.dtype, device=like.device)
            self.values = torch.empty_like(self.keys)
        return self.keys, self.values


class QuantizedKVCache(LayeredKVCache):
    """A quantized KV cache for `num_layers` layers and up to `max_length` tokens per sequence (see the module
    docstring); the engine's interface: transformers' `Cache` plus `crop`, `length`, `nbytes`."""

    def __init__(self, num_layers: int, max_length: int, cfg: KVQuantConfig, rope: list[RotaryTable] | None = None):
        workspace = Workspace()
        rope = rope or [None] * num_layers
        super().__init__(layers=[QuantizedKVLayer(max_length, cfg, workspace, rope[i]) for i in range(num_layers)])
        self.max_length = max_length
        self.cfg = cfg

    @classmethod
    def for_model(cls, model, max_length: int, cfg: KVQuantConfig) -> "QuantizedKVCache":
        n = model.config.get_text_config(decoder=True).num_hidden_layers
        rope = rotary_tables(rope_frequencies(model, n), max_length, cfg.group_size) if cfg.pre_rope else None
        return cls(n, max_length, cfg, rope)
