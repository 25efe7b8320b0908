"""The native stack over a KIVI cache (`QuantizedKVCache`): attention reads the codes where they lie.

decoder_layers.c's `sq_decoder_layers_kvq` gets one `_KVQLayer` per layer (the addresses of the cache's codes,
scales, minima, staged keys, full-precision window and sinks) and the bounds the cache is read at (`_KVQ`). Per
chunk of 256 positions and key/value head, a decode step's queries of that head read each position once, in
registers (attention.c `attend_kivi`); a prompt's many rows read the chunk dequantized into an fp32 tile
(`fill_chunk`). What a position holds is the same for every row that reads it, so rows stay independent.

The call's new keys and values go straight behind the full-precision window where no token leaves it
(`QuantizedKVLayer.in_window`, then `grow_in_window`); on a step where tokens leave it, they go to a scratch, and
`append` hands them to each layer, which quantizes what leaves (the same Python code as the torch path: the cache's
state stays a function of its length).

Where the stack's products take int8 activations (engine.native_dot=int8, a draft's stack), the grouped codes are
read in integers as well, on AVX512-VNNI (docs/kv-cache.md "Scores on the codes"): the keys' scores and the values'
weighted sums on vpdpwssd, instead of a conversion and two FMAs per code. Every row then reads the chunks this way,
prompts included.

Which caches: plain codes at 2, 4 or 8 bits, `kv.dequant=full` (the default), fp32 activations, one sequence. Keys
quantized before rotation (`kv.pre_rope`, on by default at 2 bits) and hierarchical INT8 take the torch path. A
verify pass on a cache that must be read step by step (`read_splits`) runs its pieces one after another
(docs/kv-cache.md "The quantized caches on the native stack").
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from toolkit.kv.quantized_cache import QuantizedKVLayer

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _KVQLayer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("k_codes", "v_codes", "k_scale", "k_min", "v_scale", "v_min", "k8_codes",
                                        "k8_scale", "k8_min", "k_res", "v_res", "k_sink", "v_sink", "k_new", "v_new")]


class _KVQ(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("bits", "group", "vgroup", "flushed_keys", "flushed_values", "sink",
                                          "key_cap", "value_cap", "res_cap", "sink_cap", "new_rows", "new_at",
                                          "int_scores")]


def reads(layer) -> bool:
    """Whether the stack reads this cache layer's codes (see the module docstring); cheap checks only."""
    if type(layer) is not QuantizedKVLayer or not layer.is_initialized:
        return False
    cfg = layer.cfg
    return (cfg.dequant == "full" and not cfg.hierarchical and not cfg.pre_rope and layer.dtype == torch.float32
            and layer.k_res.shape[0] == 1 and layer.device.type == "cpu")


class KIVIView:
    """The stack's view of the caches it reads: per cache (weakly held: a cache dropped takes its entry along; a copy
    is another cache), the per-layer address structs -- one array with the new rows going to a scratch, one with them
    going in place behind the full-precision window -- remade only when some layer's buffers were (re)made
    (`QuantizedKVLayer.buffer_epoch`) or the scratch was; and the scratch for a call's new keys and values."""

    def __init__(self):
        self._arrays = weakref.WeakKeyDictionary()  # cache -> ((epoch, scratch address), (scratch, in place))
        self._new = None  # [2, layers, kv_heads * rows * head_dim] fp32: keys, values

    def _scratch(self, n_layers: int, kv_heads: int, rows: int, head_dim: int) -> torch.Tensor:
        size = kv_heads * rows * head_dim
        if self._new is None or self._new.shape[1] != n_layers or self._new.shape[2] < size:
            self._new = torch.empty(2, n_layers, size)
        return self._new

    def structs(self, cache, layers: list, rows: int, kv_heads: int, head_dim: int, in_place: bool,
                int_scores: bool = False):
        """(the layers' `_KVQLayer` array, the bounds' `_KVQ`) for a call of `rows` rows, its new keys and values
        written in place behind each layer's full-precision window (`in_place`: `QuantizedKVLayer.in_window`) or to
        the scratch (`append` after the call). `int_scores`: the stack's products take int8 activations, and the
        grouped codes are read in integers too where the kernel can (attention.c `int_query`, `int_value_sums`)."""
        new = self._scratch(len(layers), kv_heads, rows, head_dim)
        key = (QuantizedKVLayer.buffer_epoch, new.data_ptr(), len(layers))
        held = self._arrays.get(cache)
        if held is None or held[0] != key:
            def ptr(t):
                return None if t is None else t.data_ptr()

            def array(window: bool):
                return (_KVQLayer * len(layers))(*(_KVQLayer(
                    *map(ptr, (layer.k_codes[0], layer.v_codes[0], layer.k_scale, layer.k_min, layer.v_scale,
                               layer.v_min, layer.k8_codes, layer.k8_scale, layer.k8_min, layer.k_res, layer.v_res,
                               getattr(layer, "k_sink", None), getattr(layer, "v_sink", None))),
                    *map(ptr, (layer.k_res, layer.v_res) if window else (new[0, i], new[1, i])))
                    for i, layer in enumerate(layers)))

            held = key, (array(False), array(True))
            self._arrays[cache] = held
        first, cfg = layers[0], layers[0].cfg
        res_cap = first.k_res.shape[2]
        new_rows, new_at = (res_cap, first.length - first.v_quantized) if in_place else (rows, 0)
        bounds = _KVQ(cfg.bits, cfg.group_size, first.value_group, first.quantized, first.v_quantized,
                      min(cfg.sink, first.v_quantized), first.k_codes[0].shape[2], first.v_codes[0].shape[2],
                      res_cap, cfg.sink, new_rows, new_at, int(int_scores))
        return held[1][in_place], bounds

    def append(self, layers: list, rows: int, kv_heads: int, head_dim: int) -> None:
        """Each layer's new keys and values (the last call's, from the scratch) appended to it."""
        n = kv_heads * rows * head_dim
        for i, layer in enumerate(layers):
            layer.append(self._new[0, i, :n].view(1, kv_heads, rows, head_dim),
                         self._new[1, i, :n].view(1, kv_heads, rows, head_dim))
