"""A KIVI-style quantized KV cache that transformers' attention writes into, croppable exactly.

Layout per layer (batch B, kv heads H, head dim D, group G, residual R, rollback S, Gv = min(G, D)):
  * keys and values leave the full-precision window together: the first Tv = cfg.flushed_values(length) tokens
    are quantized (all but the last R, VALUE_FLUSH = 8 at a time: quantizing one token per layer per step costs
    ~30 small ops); the last R to R + 7 tokens stay in full precision.
  * values: per token over Gv channels, codes [B, H, T, D*bits/8] + fp16 scale/min [B, H, T, D/Gv, 1], as in KIVI.
  * keys: per channel over G tokens, which must all have arrived before their group can be quantized. Until then
    (Tk = cfg.flushed_tokens(length) <= position < Tv, fewer than G tokens) a key is staged as INT8 per token over
    Gv channels in a ring of 2G slots (k8_*); a group is made of its staged keys once the last of them is staged:
    codes [B, H, T, D*bits/8] + fp16 scale/min [B, H, T/G, 1, D]. Staging is what keeps an INT4 cache at g128 r32
    under 0.30x a bf16 cache at 2048 tokens: in full precision the waiting keys cost 3% of it.
    (hierarchical INT8: group codes as two packed 4-bit planes, hi and lo; same bytes as INT8.)
  * the first cfg.sink tokens' keys and values (attention sinks: BOS draws attention from every later token, and its
    key is unlike the rest of its group) also kept in full precision, and read back instead of their codes.
  * with cfg.pre_rope, keys are quantized into groups un-rotated and rotated back when read (toolkit/kv/rope.py);
    with cfg.value_clip each value's range is searched for the least error (toolkit/kv/quantize.py).
  * with crop_shadow, what a crop of up to S = cfg.rollback tokens needs: the originals of the last S + 7 keys and
    values that left the window (a crop of S can un-flush one chunk of 8 more), and the ring's staged codes of the
    last group while a crop that deep could still reach below it (until length >= Tk + R + S).

Why: the state is a function of the length alone (`flushed_tokens`, `flushed_values`), never of how the tokens came
(prefill, decode, speculative verify), so a crop must leave what a cache built fresh at the shorter length holds:
the un-flushed tokens' originals back in full precision (dequantize-requantize cannot give them back; the shadows
can) and the un-flushed group's keys back in staging (the ring still holds their INT8 codes, and a fresh cache makes
its groups from staged keys too). kv.rollback defaults to 1 (a decode step can be redone); speculative decoding
raises it to k + 1 on the caches it makes (`KVSpec.with_rollback`). A crop that would need what is no longer kept
raises instead of silently diverging. All of it is counted in `nbytes`; without shadows (`kv.crop_shadow=false`)
crops that stay inside the full-precision window still work and deeper ones raise.

What attention gets: the groups, staged keys and quantized values dequantized, then the full-precision tokens and
the new ones, i.e. tokens are read back quantized only from the step after they were flushed (as KIVI and
transformers' QuantizedCache do). They are assembled in one `Workspace` shared by the cache's layers (codes unpacked
straight into floats, scaled in place, the full-precision tokens written behind them: no concatenation), so what
`update` returns is valid until the next `update` of any layer of the cache. `dequant="cached"` keeps a dequantized
float copy updated only when tokens flush: same values, but it holds a float copy of the whole cache, which defeats
the purpose; it exists to measure against.
"""

import dataclasses

import torch

from toolkit.errors import InputError
from toolkit.kv import native
from toolkit.kv.config import VALUE_FLUSH, KVQuantConfig
from toolkit.kv.contiguous import CountedKVLayer, LayeredKVCache
from toolkit.kv.quantize import (
    CLIP_GRID,
    dequantize_groups,
    pack,
    quantize_groups,
    split_planes,
    unpack,
    unpack_into,
)
from toolkit.kv.rope import RotaryTable, rope_frequencies, rotary_tables
from toolkit.kv.window import Window, slide_quantized


class QuantizedKVLayer(CountedKVLayer):
    _slide = staticmethod(slide_quantized)  # a window drops whole key groups (toolkit/kv/window.py)
    # bumped whenever any layer's buffers are (re)made (first update, reorder_cache): the native stack keeps its
    # arrays of their addresses while this is unchanged (toolkit/engine/native_kv.py)
    buffer_epoch = 0

    def __init__(self, max_length: int, cfg: KVQuantConfig, workspace: "Workspace | None" = None,
                 rope: RotaryTable | None = None, window: Window | None = None, inv_freq: torch.Tensor | None = None):
        super().__init__()
        self.window, self.inv_freq = window, inv_freq  # kv.window (toolkit/kv/window.py)
        if cfg.pre_rope and rope is None:
            raise InputError("kv.pre_rope=true needs the model's rotary frequencies",
                             "build the cache with QuantizedKVCache.for_model, or set kv.pre_rope=false")
        self.cfg = cfg
        self.rope = rope
        self.workspace = workspace or Workspace()
        self.max_length = max_length
        self.length = 0  # tokens held
        self.quantized = 0  # keys in groups (a multiple of the group size): Tk
        self.v_quantized = 0  # values quantized, and keys quantized at all (groups + staging): Tv
        self.shadow_n = 0  # the shadows' last shadow_n rows hold the originals of keys/values [Tv - n, Tv)
        self.ring_floor = 0  # the ring holds the INT8 codes of every key in [ring_floor, Tv)

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
        # staged keys, INT8 per token, at ring slot position % 2G: [Tk, Tv) (< G tokens) and the group flushed last
        self.k8_codes = torch.empty(B, H, 2 * G, D, **u8)
        self.k8_scale = torch.empty(B, H, 2 * G, D // self.value_group, 1, **f16)
        self.k8_min = torch.empty_like(self.k8_scale)
        self.k_res = torch.empty(B, H, cfg.residual + VALUE_FLUSH, D, **fp)
        self.v_res = torch.empty_like(self.k_res)
        if cfg.sink:
            self.k_sink = torch.empty(B, H, cfg.sink, D, **fp)
            self.v_sink = torch.empty_like(self.k_sink)
        if cfg.crop_shadow:
            self.k_shadow = torch.empty(B, H, cfg.value_shadow, D, **fp)
            self.v_shadow = torch.empty_like(self.k_shadow)
        if cfg.dequant == "cached":
            self.k_float = torch.empty(B, H, self.max_length, D, **fp)
            self.v_float = torch.empty_like(self.k_float)
            self.k_synced = self.v_synced = 0  # quantized tokens already written dequantized into the float copy
        self.is_initialized = True
        QuantizedKVLayer.buffer_epoch += 1

    def _put(self, codes: torch.Tensor, dest: list[torch.Tensor], start: int) -> None:
        planes = split_planes(codes) if self.cfg.hierarchical else (pack(codes, self.cfg.bits),)
        for plane, buf in zip(planes, dest):
            buf[:, :, start:start + codes.shape[2]] = plane

    def _store_keys(self, start: int, k: torch.Tensor) -> None:
        """Quantize whole key groups k [B, H, n*G, D] (fp32) into positions start.. of the grouped keys."""
        G = self.cfg.group_size
        B, H, n, D = k.shape
        if self.cfg.pre_rope:
            k = self.rope.rotate_(k, start, inverse=True)
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

    def _ring_runs(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(slot, offset, count) runs covering positions [start, end) of the ring (at most 2G of them)."""
        size, runs, pos = self.k8_codes.shape[2], [], start
        while pos < end:
            slot = pos % size
            count = min(end - pos, size - slot)
            runs.append((slot, pos - start, count))
            pos += count
        return runs

    def _stage_keys(self, start: int, k: torch.Tensor) -> torch.Tensor:
        """INT8-quantize keys k [B, H, n, D] of positions start.., keep the codes of those the ring must hold
        (the last 2G at most), and return them dequantized (fp32): what the groups are later made of."""
        B, H, n, D = k.shape
        vg = self.value_group
        codes, scale, mn = quantize_groups(k.view(B, H, n, D // vg, vg), 8, dim=-1)
        first = max(start, start + n - self.k8_codes.shape[2])
        for slot, off, count in self._ring_runs(first, start + n):
            src = slice(first - start + off, first - start + off + count)
            self.k8_codes[:, :, slot:slot + count] = codes[:, :, src].view(B, H, count, D)
            self.k8_scale[:, :, slot:slot + count] = scale[:, :, src]
            self.k8_min[:, :, slot:slot + count] = mn[:, :, src]
        self.ring_floor = max(self.ring_floor, start + n - self.k8_codes.shape[2])
        return dequantize_groups(codes, scale, mn, torch.float32).view(B, H, n, D)

    def _read_staged(self, start: int, end: int, out: torch.Tensor) -> torch.Tensor:
        """Staged keys [start, end) dequantized from the ring into `out` [B, H, end-start, D]."""
        B, H, _, D = out.shape
        vg = self.value_group
        for slot, off, count in self._ring_runs(start, end):
            dest = out[:, :, off:off + count]
            dest.copy_(torch.addcmul(self.k8_min[:, :, slot:slot + count].float(),
                                     self.k8_codes[:, :, slot:slot + count].view(B, H, count, D // vg, vg).float(),
                                     self.k8_scale[:, :, slot:slot + count].float()).view(B, H, count, D))
        return out

    def _fused(self, out: torch.Tensor, hi_only: bool, rotate: bool) -> bool:
        """Whether this read goes through the fused kernel: kv.dequant other than torch, plain codes (hierarchical
        planes and their INT4 reading stay on torch ops), an output the kernel can write, and codes that need
        unpacking or a rotation: plain 8-bit codes are one conversion, which torch's own copy does as fast (the
        kernel was no faster for them in benchmarks.kv, and its single unpack step buys nothing there)."""
        return (self.cfg.dequant != "torch" and not self.cfg.hierarchical and not hi_only
                and (self.cfg.bits < 8 or rotate) and native.supported(out, self.cfg.bits)
                and native.kernel() is not None)

    def _dequantize_into(self, out: torch.Tensor, planes: list[torch.Tensor], scale: torch.Tensor, mn: torch.Tensor,
                         span: tuple[int, int], grouped: tuple[int, ...], hi_only: bool, kind: str,
                         rotate: bool = False) -> torch.Tensor:
        """codes * scale + min written into `out` [B, H, n, D] (fp32 arithmetic, then the cache dtype), the codes of
        positions `span` viewed as [B, H, *grouped] to meet their scales, rotated back for pre-RoPE keys. The codes
        are unpacked straight into the output and scaled in place: no uint8 -> float copy, no concatenation after."""
        start, end = span
        if self._fused(out, hi_only, rotate):  # one pass in C (toolkit/kv/native.py), the same values as the ops below
            rope = (self.rope.cos[start:end], self.rope.sin[start:end]) if rotate else ()
            return native.dequantize(kind, planes[0][:, :, start:end], scale, mn, out, self.cfg.bits,
                                     self.cfg.group_size if kind == "keys" else self.value_group, *rope)
        work = out if out.dtype == torch.float32 else torch.empty(out.shape, device=out.device)
        if hi_only:  # the INT4 reading of hierarchical codes: the bucket centre 16 * hi + 7.5
            unpack_into(planes[0][:, :, start:end], 4, work).mul_(16).add_(7.5)
        elif self.cfg.hierarchical:  # 16 * hi + lo
            unpack_into(planes[0][:, :, start:end], 4, work).mul_(16).add_(unpack(planes[1][:, :, start:end], 4))
        else:
            unpack_into(planes[0][:, :, start:end], self.cfg.bits, work)
        work.view(*work.shape[:2], *grouped).mul_(scale.float()).add_(mn.float())
        if rotate:
            self.rope.rotate_(work, start)
        return out if work is out else out.copy_(work)

    def dequantize_keys(self, start: int = 0, end: int | None = None, hi_only: bool = False,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """Grouped keys [B, H, end-start, D] (a group-aligned range) in the cache dtype, into `out` when given;
        `hi_only`: the INT4 reading of hierarchical codes."""
        G = self.cfg.group_size
        end = self.quantized if end is None else end
        if out is None:
            B, H, _, D = self.k_res.shape
            out = torch.empty(B, H, end - start, D, dtype=self.dtype, device=self.device)
        D = out.shape[-1]
        return self._dequantize_into(out, self.k_codes, self.k_scale[:, :, start // G:end // G],
                                     self.k_min[:, :, start // G:end // G], (start, end), ((end - start) // G, G, D),
                                     hi_only, "keys", rotate=self.cfg.pre_rope)

    def dequantize_values(self, start: int = 0, end: int | None = None, hi_only: bool = False,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        end = self.v_quantized if end is None else end
        if out is None:
            B, H, _, D = self.k_res.shape
            out = torch.empty(B, H, end - start, D, dtype=self.dtype, device=self.device)
        D, vg = out.shape[-1], self.value_group
        return self._dequantize_into(out, self.v_codes, self.v_scale[:, :, start:end], self.v_min[:, :, start:end],
                                     (start, end), (end - start, D // vg, vg), hi_only, "values")

    # ---- the Cache layer interface --------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, hi_only: bool = False,
               continues_from: int | None = None, **kwargs):
        """`continues_from`: this call is the next piece of a pass read in pieces (`QuantizedKVCache.read_splits`),
        right after this layer's previous piece, which read the cache at that length and whose reading is still in
        the workspace: only the slots the flush in between changed are read again."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        if self.length + t > self.max_length:
            raise RuntimeError(f"KV cache overflow: {self.length + t} tokens > max_length {self.max_length}")
        # an empty cache's read is the new tokens themselves, not the workspace: nothing to continue from there
        if continues_from and self.cfg.dequant != "cached" and not hi_only:
            keys, values = self._read_on(key_states, value_states, continues_from)
        else:
            keys, values = self._read(key_states, value_states, hi_only)
        self._append(key_states, value_states)
        return keys, values

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store new tokens without reading the cache: what `update` does after its read (the native stack reads
        the codes itself, toolkit/engine/native_kv.py)."""
        if self.length + key_states.shape[-2] > self.max_length:
            raise RuntimeError(f"KV cache overflow: {self.length + key_states.shape[-2]} tokens > max_length "
                               f"{self.max_length}")
        self._append(key_states, value_states)

    def in_window(self, n: int) -> bool:
        """Whether `n` new tokens stay behind the full-precision window without any token leaving it (no flush) and
        with the sink tokens already in: then they can be written in place there (`grow_in_window`)."""
        cfg = self.cfg
        return (self.is_initialized and cfg.dequant != "cached" and self.length >= cfg.sink
                and self.length + n <= self.max_length
                and cfg.flushed_values(self.length + n) == self.v_quantized)

    def grow_in_window(self, n: int) -> None:
        """Count `n` tokens the native stack wrote in place behind the full-precision window (k_res / v_res rows
        length - Tv ..; toolkit/engine/native_kv.py), where the caller found `in_window(n)` before writing them (once
        for all layers: they share the config and the length): the state a cache of this length holds, as `append`
        would leave it."""
        self.length += n

    def _read_on(self, k_new, v_new, then: int):
        """`_read`'s values from the workspace left by this layer's read at length `then` (the previous piece's):
        the flush since moved keys [Tk_then, Tk) from staging into groups and keys and values [Tv_then, Tv) out of
        the window, so slots from the lower of those on are read again, the rest kept."""
        tk, tv = self.cfg.reading_bounds(then)
        keys, values = self.workspace.get(k_new, self.max_length)
        end = self.length + k_new.shape[-2]
        keys, values = keys[:, :, :end], values[:, :, :end]
        start = tk if self.quantized != tk else tv
        self._fill(keys[:, :, start:], values[:, :, start:], start)
        keys[:, :, self.length:], values[:, :, self.length:] = k_new, v_new
        return keys, values

    def _read(self, k_new, v_new, hi_only):
        """What attention sees for this step: grouped keys and quantized values dequantized, staged keys, the
        full-precision tokens, the new ones; the sink tokens' originals in place of their codes."""
        if self.length == 0:
            return k_new, v_new
        Tk, Tv, end = self.quantized, self.v_quantized, self.length + k_new.shape[-2]
        if self.cfg.dequant == "cached" and not hi_only:
            if self.k_synced < Tk:
                self.dequantize_keys(self.k_synced, out=self.k_float[:, :, self.k_synced:Tk])
                self.k_synced = Tk
            if self.v_synced < Tv:
                self.dequantize_values(self.v_synced, out=self.v_float[:, :, self.v_synced:Tv])
                self.v_synced = Tv
            keys, values = self.k_float[:, :, :end], self.v_float[:, :, :end]
            self._overlay(keys, values, 0)
        else:
            keys, values = self.workspace.get(k_new, self.max_length)
            keys, values = keys[:, :, :end], values[:, :, :end]
            self._fill(keys, values, 0, hi_only)
        keys[:, :, self.length:], values[:, :, self.length:] = k_new, v_new
        return keys, values

    def _fill(self, keys: torch.Tensor, values: torch.Tensor, start: int, hi_only: bool = False) -> None:
        """Cached slots start.. as attention reads them, written into keys/values [B, H, >= length - start, D]
        (index 0 = slot `start`): the full-precision window, quantized values, grouped keys (whole groups
        dequantized, the range kept), then `_overlay`."""
        Tk, Tv, G = self.quantized, self.v_quantized, self.cfg.group_size
        first = max(start, Tv)
        keys[:, :, first - start:self.length - start] = self.k_res[:, :, first - Tv:self.length - Tv]
        values[:, :, first - start:self.length - start] = self.v_res[:, :, first - Tv:self.length - Tv]
        if Tv > start:
            self.dequantize_values(start, Tv, hi_only=hi_only, out=values[:, :, :Tv - start])
        if Tk > start and start % G == 0:
            self.dequantize_keys(start, Tk, hi_only=hi_only, out=keys[:, :, :Tk - start])
        elif Tk > start:
            group_start = start // G * G
            whole = self.dequantize_keys(group_start, Tk, hi_only=hi_only)
            keys[:, :, :Tk - start] = whole[:, :, start - group_start:]
        self._overlay(keys, values, start)

    def _overlay(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Over a read from slot `start`: the staged keys, and the sink tokens' originals in place of their codes."""
        Tk, Tv = self.quantized, self.v_quantized
        first = max(start, Tk)
        if Tv > first:
            self._read_staged(first, Tv, keys[:, :, first - start:Tv - start])
        sink = min(self.cfg.sink, Tv)
        if sink > start:
            keys[:, :, :sink - start] = self.k_sink[:, :, start:sink]
            values[:, :, :sink - start] = self.v_sink[:, :, start:sink]

    def attention_view(self, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached tokens start.. as attention reads them (dequantized; the full-precision window and sinks as they
        are), [B, H, length - start, D]. From 0: views of the workspace (`_read`), valid until the cache's next
        `update`. From later: new tensors, only that range read (a shared-KV draft's few new slots a round), the
        same values."""
        if start == 0:
            none = self.k_res[:, :, :0]
            return self._read(none, none, False)
        B, H, _, D = self.k_res.shape
        keys = torch.empty(B, H, self.length - start, D, dtype=self.dtype, device=self.device)
        values = torch.empty_like(keys)
        self._fill(keys, values, start)
        return keys, values

    def _append(self, k_new, v_new):
        new_length = self.length + k_new.shape[-2]
        cfg = self.cfg
        if self.length < cfg.sink:  # the first tokens' originals, read back once they are quantized
            n = min(cfg.sink, new_length) - self.length
            self.k_sink[:, :, self.length:self.length + n] = k_new[:, :, :n]
            self.v_sink[:, :, self.length:self.length + n] = v_new[:, :, :n]
        if cfg.dequant == "cached":  # the full-precision tokens, at their place in the float copy
            self.k_float[:, :, self.length:new_length] = k_new
            self.v_float[:, :, self.length:new_length] = v_new
        Tk, Tv = self.quantized, self.v_quantized
        new_k, new_v = cfg.flushed_tokens(new_length), cfg.flushed_values(new_length)
        # keys and values leave the full-precision window together (Tv), VALUE_FLUSH at a time
        k_out = self._advance(self.k_res, Tv, k_new, new_v)
        v_out = self._advance(self.v_res, Tv, v_new, new_v)
        if v_out is not None:
            if new_k > Tk:  # whole groups leave staging: read the ring's part before this step's keys overwrite it
                B, H, _, D = k_out.shape
                older = self._read_staged(Tk, min(Tv, new_k), torch.empty(B, H, max(0, min(Tv, new_k) - Tk), D,
                                                                          device=self.device))
            staged = self._stage_keys(Tv, k_out)
            if new_k > Tk:  # the groups are made of staged (INT8) keys, so a fresh cache makes the same ones
                self._store_keys(Tk, torch.cat([older, staged[:, :, :max(0, new_k - Tv)]], dim=-2))
            self._store_values(Tv, v_out)
            if cfg.value_shadow:
                self._push_shadow(k_out, v_out)
        self.quantized, self.v_quantized, self.length = new_k, new_v, new_length

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

    def _push_shadow(self, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Keep the originals of the last S keys and values that left the full-precision window."""
        S, n = self.cfg.value_shadow, k_out.shape[-2]
        for shadow, out in ((self.k_shadow, k_out), (self.v_shadow, v_out)):
            if n >= S:
                shadow.copy_(out[:, :, n - S:])
            else:
                shadow[:, :, :S - n] = shadow[:, :, n:].clone()
                shadow[:, :, S - n:] = out
        self.shadow_n = min(S, self.shadow_n + n)

    def _group_kept(self) -> bool:
        """The ring still counts the last flushed group: while a crop of `rollback` tokens could un-flush it
        (length < Tk + R + rollback)."""
        cfg = self.cfg
        return cfg.crop_shadow and self.quantized > 0 and self.length < self.quantized + cfg.residual + cfg.rollback

    def _cannot_crop(self, new_length: int, what: str) -> InputError:
        return InputError(
            f"cannot crop the quantized KV cache from {self.length} to {new_length} tokens exactly: that needs the "
            f"{what}, and only the last kv.rollback={self.cfg.rollback} tokens' worth is kept"
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
        Tk, Tv = self.quantized, self.v_quantized
        new_k, new_v = cfg.flushed_tokens(new_length), cfg.flushed_values(new_length)
        # a group goes back to staging: its INT8 codes must still be in the ring, and counted
        if new_k < Tk and new_v > new_k and not (self._group_kept() and new_k == Tk - G
                                                 and self.ring_floor <= new_k):
            raise self._cannot_crop(new_length, f"staged INT8 codes of keys {new_k}..{min(Tk, new_v)}")
        back = Tv - new_v if new_v < Tv and new_length > new_v else 0  # un-flushed: back to full precision
        if back > self.shadow_n:
            raise self._cannot_crop(new_length, f"full-precision keys and values of tokens {new_v}..{Tv}")
        if back:  # the last `back` shadow rows are tokens [new_v, Tv): those below new_length come back
            S, m = cfg.value_shadow, max(0, new_length - Tv)
            keep = min(back, new_length - new_v)
            for res, shadow in ((self.k_res, self.k_shadow), (self.v_res, self.v_shadow)):
                res[:, :, keep:keep + m] = res[:, :, :m].clone()
                res[:, :, :keep] = shadow[:, :, S - back:S - back + keep]
                shadow[:, :, back:] = shadow[:, :, :S - back].clone()
            self.shadow_n -= back
        elif new_v < Tv:  # cropped below every token the shadows held
            self.shadow_n = 0
        if cfg.dequant == "cached" and self.is_initialized:
            self.k_synced, self.v_synced = min(self.k_synced, new_k), min(self.v_synced, new_v)
            self.k_float[:, :, new_v:new_length] = self.k_res[:, :, :new_length - new_v]
            self.v_float[:, :, new_v:new_length] = self.v_res[:, :, :new_length - new_v]
        self.quantized, self.v_quantized = min(Tk, new_k), min(Tv, new_v)
        self.length = new_length

    def reset(self) -> None:
        self.crop(0)

    _BATCHED = ("k_scale", "k_min", "v_scale", "v_min", "k8_codes", "k8_scale", "k8_min", "k_res", "v_res",
                "k_shadow", "v_shadow", "k_sink", "v_sink", "k_float", "v_float", "sink_keys")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows of the batch picked (and repeated) by `beam_idx`, in every per-row buffer: codes, scales, minima,
        staged keys, residuals, shadows and float copy (beam search's reorder; evaluation's one context, several
        endings)."""
        if not self.is_initialized:
            return
        QuantizedKVLayer.buffer_epoch += 1
        idx = beam_idx.to(self.device)
        self.k_codes = [c.index_select(0, idx) for c in self.k_codes]
        self.v_codes = [c.index_select(0, idx) for c in self.v_codes]
        for name in self._BATCHED:
            if getattr(self, name, None) is not None:
                setattr(self, name, getattr(self, name).index_select(0, idx))

    # ---- bytes --------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the state a cache of this length holds: codes and scales/minima of the grouped keys, staged
        keys and quantized values, the full-precision tokens, the shadows and the ring's last group while they
        are counted, the sink tokens' originals once quantized, the float copy if cached (not the rotary table of
        pre_rope: one per model, not per sequence)."""
        if not self.is_initialized:
            return 0
        Tk, Tv, G, cfg = self.quantized, self.v_quantized, self.cfg.group_size, self.cfg

        def rows(t: torch.Tensor, n: int) -> int:
            return t[:, :, :1].numel() * t.element_size() * n

        def staged(n: int) -> int:
            return rows(self.k8_codes, n) + rows(self.k8_scale, n) * 2

        total = sum(rows(c, Tk) for c in self.k_codes) + sum(rows(c, Tv) for c in self.v_codes)
        total += rows(self.k_scale, Tk // G) * 2 + rows(self.v_scale, Tv) * 2 + staged(Tv - Tk)
        total += rows(self.k_res, self.length - Tv) + rows(self.v_res, self.length - Tv)
        if cfg.sink:
            total += rows(self.k_sink, min(cfg.sink, Tv)) * 2
        if cfg.crop_shadow:  # what a cache of this length holds (a crop may have used up part of it)
            total += staged(G) if self._group_kept() else 0
            total += rows(self.k_shadow, min(cfg.value_shadow, Tv)) * 2
        if cfg.dequant == "cached":
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

    def __init__(self, num_layers: int, max_length: int, cfg: KVQuantConfig, rope: list[RotaryTable] | None = None,
                 window: Window | None = None, inv_freqs: list[torch.Tensor] | None = None):
        workspace = Workspace()
        rope = rope or [None] * num_layers
        inv_freqs = inv_freqs or [None] * num_layers
        super().__init__(layers=[QuantizedKVLayer(max_length, cfg, workspace, rope[i], window, inv_freqs[i])
                                 for i in range(num_layers)])
        self.max_length = max_length
        self.cfg = cfg
        self.call_rows = window.slack if window is not None else None

    def read_splits(self, tokens: int) -> list[int]:
        """With `stepwise_reads` (a speculative verify pass): where the reading bounds move inside a pass of `tokens`.
        A multi-token pass reads the cache as it stands at its start (`_read`), but one-token decoding reads the
        token at position p against the bounds at length p, so a flush falling inside the pass (every VALUE_FLUSH
        tokens past the window) would let the pass's later rows read a few tokens in full precision that decoding
        reads quantized, and greedy speculation could drift from the target alone. Updating the cache piece by
        piece at these offsets gives each row exactly its step's reading (the state is a function of the length).
        Empty otherwise (a prompt's pass reads as at its start, as in KIVI)."""
        if not self.stepwise_reads or tokens < 2:
            return []
        bounds, start = self.cfg.reading_bounds, self.length
        return [j for j in range(1, tokens) if bounds(start + j) != bounds(start + j - 1)]

    @classmethod
    def for_model(cls, model, max_length: int, cfg: KVQuantConfig) -> "QuantizedKVCache":
        n = model.config.get_text_config(decoder=True).num_hidden_layers
        rope = rotary_tables(rope_frequencies(model, n), max_length, cfg.group_size) if cfg.pre_rope else None
        return cls(n, max_length, cfg, rope)

    @classmethod
    def windowed(cls, model, window: Window, cfg: KVQuantConfig) -> "QuantizedKVCache":
        """A cache keeping a head of `window.sink` tokens (whole key groups, held in full precision as its `sink`
        originals, so it can be turned) and the last `window.size` (toolkit/kv/window.py, KVSpec.window_shape)."""
        cfg = dataclasses.replace(cfg, sink=window.sink)
        n = model.config.get_text_config(decoder=True).num_hidden_layers
        freqs = rope_frequencies(model, n, "kv.sink") if window.sink else None
        return cls(n, window.capacity, cfg, None, window, freqs)
