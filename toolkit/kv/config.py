"""The `kv` config group (conf/kv/*.yaml) resolved once: `KVSpec` (the kind) and `KVQuantConfig` (a quantized
cache's options), read from the node and checked."""

import dataclasses
from dataclasses import dataclass

import torch

from toolkit import cpu
from toolkit.errors import InputError
from toolkit.kv.quantize import ALLOWED_BITS
from toolkit.kv.window import Window
from toolkit.model_state import peek
from toolkit.settings import check_kind, node_values, refuse_unknown

DEQUANT_MODES = ("full", "torch", "cached")
# Tokens leave the full-precision window this many at a time (values quantized per token, keys staged per token):
# quantizing one token per layer per decode step costs ~30 small ops (~0.2 ms a layer on this CPU), an eighth of that
# in chunks of 8, at most 7 more tokens in full precision.
VALUE_FLUSH = 8


@dataclass(frozen=True)
class KVQuantConfig:
    bits: int = 4
    group_size: int = 32  # tokens per key scale (per channel); channels per value scale, capped at head_dim
    residual: int = 128  # the most recent tokens kept in full precision (KIVI's R)
    hierarchical: bool = False  # INT8 stored as two INT4 planes; the high plane is a valid INT4 cache
    crop_shadow: bool = True  # keep full-precision shadows so a crop of up to `rollback` tokens stays exact
    rollback: int = 1  # the deepest crop kept exact: one decode step; speculative decoding raises it to k + 1
    # "full": dequantize the quantized part per step, in one fused pass (toolkit/kv/native.py) where the kernel builds;
    # "torch": the same with torch ops (the reference, and the fallback); "cached": keep a float copy (no saving)
    dequant: str = "full"
    sink: int = 1  # the first tokens (attention sinks, BOS) also kept in full precision once quantized
    pre_rope: bool = False  # quantize keys un-rotated (toolkit/kv/rope.py); from_node: on at 2 bits
    value_clip: bool = False  # search each value group's range for the least error (quantize.CLIP_GRID); on at 2 bits

    def __post_init__(self):
        if self.bits not in ALLOWED_BITS:
            raise InputError(f"kv.bits={self.bits} is not supported", f"use kv.bits one of {ALLOWED_BITS}")
        if self.group_size < 8 or self.group_size & (self.group_size - 1):
            raise InputError(f"kv.group_size={self.group_size} is not a power of two >= 8",
                             "use kv.group_size=32, 64 or 128")
        if self.rollback < 0:
            raise InputError(f"kv.rollback={self.rollback} is negative",
                             "use kv.rollback >= 0 (default 1; speculative decoding sets k + 1 itself)")
        if self.sink < 0:
            raise InputError(f"kv.sink={self.sink} is negative", "use kv.sink >= 0 (default 1: the first token)")
        if self.residual < 0:
            raise InputError(f"kv.residual={self.residual} is negative", "use kv.residual >= 0 (default 128)")
        if self.hierarchical and self.bits != 8:
            raise InputError("kv.hierarchical=true needs 8-bit codes", "use kv=int8 kv.hierarchical=true")
        if self.dequant not in DEQUANT_MODES:
            raise InputError(f"kv.dequant={self.dequant!r} is unknown", f"use one of {DEQUANT_MODES}")

    @classmethod
    def from_node(cls, node) -> "KVQuantConfig":
        get = node.get if hasattr(node, "get") else (lambda k, d=None: d)
        bits = int(get("bits", 4))
        low = bits == 2  # at 4 levels the key rotation and the value tails cost most (docs/kv-cache.md: the ablation rows)
        return cls(bits=bits, group_size=int(get("group_size", 32)), residual=int(get("residual", 128)),
                   hierarchical=bool(get("hierarchical", False)), crop_shadow=bool(get("crop_shadow", True)),
                   rollback=int(get("rollback", 1)), dequant=str(get("dequant", "full")), sink=int(get("sink", 1)),
                   pre_rope=bool(get("pre_rope", low)), value_clip=bool(get("value_clip", low)))

    def flushed_values(self, length: int) -> int:
        """Values held quantized when `length` tokens are cached: all but the last `residual`, rounded down to a
        multiple of VALUE_FLUSH (values are quantized per token, so no group has to fill up first)."""
        return max(0, length - self.residual) // VALUE_FLUSH * VALUE_FLUSH

    @property
    def value_shadow(self) -> int:
        """Flushed tokens whose original keys and values are kept: a crop of `rollback` tokens can un-flush
        VALUE_FLUSH - 1 more."""
        return self.rollback + VALUE_FLUSH - 1 if self.crop_shadow and self.rollback else 0

    def reading_bounds(self, length: int) -> tuple[int, int]:
        """(flushed_tokens, flushed_values) at `length`: below the first slot keys are read from groups, below the
        second values are read quantized (and keys staged). Both only grow with the length."""
        return self.flushed_tokens(length), self.flushed_values(length)

    def flushed_tokens(self, length: int) -> int:
        """Keys held in groups when `length` are cached: the largest whole number of groups leaving at least
        `residual` tokens out (the rest of the flushed keys are staged per token). A function of the length alone,
        so the state never depends on how the tokens were chunked (prefill, decode, speculative verify): what makes
        crop-then-append exact."""
        if length <= self.residual:
            return 0
        return (length - self.residual) // self.group_size * self.group_size


KINDS = ("fp", "int8", "int4", "int2")
_BITS = {"int8": 8, "int4": 4, "int2": 2}


# kv.dtype: what a full-precision cache stores (docs/kv-cache.md "The float cache in 2 bytes"); attention always
# accumulates in fp32
FP_DTYPES = ("auto", "fp32", "fp16", "bf16")


@dataclass(frozen=True)
class KVSpec:
    """The `kv` config group (conf/kv/*.yaml) resolved once: the cache's kind and, for a quantized kind, its options
    (`quant`, checked by KVQuantConfig). `KVSpec.from_node` is the one resolver, called at the CLI boundary;
    `make_kv_cache`, the speculative loop, eval, bench, serve and diagnose take the KVSpec it returns."""
    kind: str = "fp"
    quant: KVQuantConfig | None = None
    # kv=fp only: "auto" = fp16 where the native stack reads the cache (one sequence, fp32 activations, an AVX512
    # CPU: `fp_storage`), else the activations' dtype; fp32 / fp16 / bf16 = that, always
    dtype: str = "auto"
    # kv.window=W: keep the first tokens and the last W to W + slack, for generation of any length in constant
    # memory (toolkit/kv/window.py, docs/kv-cache.md "Windowed caches"); 0 = keep every token. `sink`: kv=fp's
    # first tokens kept (a quantized kind's are quant.sink, rounded up to whole key groups)
    window: int = 0
    sink: int = 4

    def __post_init__(self):
        check_kind(self.kind, KINDS, "KV cache kind", "kv")
        check_kind(self.dtype, FP_DTYPES, "full-precision KV cache dtype", "kv.dtype")
        if self.window < 0 or self.sink < 0:
            raise InputError(f"kv.window={self.window} kv.sink={self.sink}: negative",
                             "use kv.window=W > 0 to keep the last W tokens (0: keep all) and kv.sink >= 0")
        cfg = self.quant
        if self.window and cfg is not None:  # what a quantized cache's drops need (toolkit/kv/window.py)
            if cfg.pre_rope:
                raise InputError(f"kv.window with kv.pre_rope=true (kv={self.kind}'s default): pre-RoPE keys are "
                                 "turned back by their slot, which a window moves", "add kv.pre_rope=false")
            if cfg.dequant == "cached":
                raise InputError("kv.window with kv.dequant=cached (a measurement mode)", "use kv.dequant=full")
            if self.window < cfg.residual + cfg.group_size:
                raise InputError(f"kv.window={self.window} is shorter than kv.residual + kv.group_size = "
                                 f"{cfg.residual + cfg.group_size}: a window drops only whole key groups",
                                 f"use kv.window >= {cfg.residual + cfg.group_size}")
        if self.kind != "fp" and self.dtype != "auto":
            raise InputError(f"kv.dtype={self.dtype} is for kv=fp; kv={self.kind} stores codes",
                             "drop kv.dtype, or use kv=fp kv.dtype=" + self.dtype)
        if self.kind == "fp" and self.quant is not None:
            raise InputError("kv=fp has no quantization options", "use kv=int8, int4 or int2")
        if self.kind != "fp":
            if self.quant is None:
                object.__setattr__(self, "quant", KVQuantConfig.from_node({"bits": _BITS[self.kind]}))
            elif self.quant.bits != _BITS[self.kind]:
                raise InputError(f"kv={self.kind} with kv.bits={self.quant.bits}",
                                 f"drop kv.bits or use kv=int{self.quant.bits}")

    @classmethod
    def from_node(cls, node=None) -> "KVSpec":
        """From a kv node (hydra's DictConfig or a dict: `kind` plus the quantized kinds' keys of conf/kv/), a kind
        name alone (its defaults), None (full precision) or a KVSpec (returned as is)."""
        if isinstance(node, KVSpec):
            return node
        if node is None:
            return cls()
        if isinstance(node, str):
            return cls(node)
        values = node_values(node)
        kind = values.pop("kind", "fp")
        check_kind(kind, KINDS, "KV cache kind", "kv")
        dtype = str(values.pop("dtype", "auto"))
        window = int(values.pop("window", 0) or 0)
        refuse_unknown(values, (f.name for f in dataclasses.fields(KVQuantConfig)), "kv",
                       f"see conf/kv/{kind if kind != 'fp' else 'int4'}.yaml for what a quantized cache takes")
        if kind == "fp":  # a quantized kind's keys left in the node are moot for a full-precision cache
            return cls(dtype=dtype, window=window, sink=int(values.get("sink", 4)))
        # a quantized kind's kv.sink is its quant.sink: the tokens kept in full precision (and a window's head)
        bits = int(values.get("bits", _BITS[kind]))
        if bits != _BITS[kind]:
            raise InputError(f"kv={kind} with kv.bits={bits}", f"drop kv.bits or use kv=int{bits}")
        return cls(kind, KVQuantConfig.from_node({**values, "bits": bits}), dtype, window)

    @property
    def quantized(self) -> bool:
        return self.kind != "fp"

    def window_shape(self) -> Window | None:
        """The window kv.window asks for, or None: a quantized cache's head is its sink tokens rounded up to whole
        key groups, and it drops two groups at a time (toolkit/kv/window.py)."""
        if not self.window:
            return None
        if self.quant is None:
            return Window(self.window, self.sink)
        G = self.quant.group_size
        return Window(self.window, -(-self.quant.sink // G) * G, 2 * G)

    @property
    def residual(self) -> int | None:
        """Tokens kept in full precision at the end of a quantized cache (None for kv=fp: all of them)."""
        return self.quant.residual if self.quant is not None else None

    def __str__(self) -> str:
        name = self.kind if self.dtype == "auto" else f"{self.kind} {self.dtype}"
        return f"{name} window {self.window}+{self.window_shape().sink}" if self.window else name

    def with_rollback(self, depth: int, what: str) -> "KVSpec":
        """This cache's spec for a cache that `what` will crop by up to `depth` tokens at a time (a speculative loop
        appends k + 1 tokens per verify pass and may roll all of them back): kv.rollback raised to `depth` where
        shorter, so the shadows are sized for it. Refuses, before anything runs, a cache kept without shadows
        (kv.crop_shadow=false) whose full-precision window is shallower than that."""
        if self.window:
            raise InputError(f"kv.window={self.window}: {what} rolls back tokens a window may already have dropped",
                             "drop kv.window, or use spec=none with it")
        cfg = self.quant
        if cfg is None:
            return self
        if not cfg.crop_shadow:
            if cfg.residual < depth:
                raise InputError(f"kv.crop_shadow=false with kv.residual={cfg.residual}: {what} rolls back up to "
                                 f"{depth} tokens, past the full-precision window",
                                 f"set kv.crop_shadow=true or kv.residual>={depth}")
            return self
        if cfg.rollback >= depth:
            return self
        return dataclasses.replace(self, quant=dataclasses.replace(cfg, rollback=depth))


def compute_dtype(model):
    """The dtype a model's activations (and so its keys and values) run in: what the engine prepared it for
    (toolkit.model_state), else its parameters' dtype."""
    precision = peek(model).precision
    return precision.compute if precision is not None else next(model.parameters()).dtype


def fp_storage(model, spec: KVSpec) -> tuple[torch.dtype | None, bool]:
    """(dtype, one_sequence) a full-precision cache for `model` stores its keys and values in, as kv.dtype says
    (ContiguousKVLayer.storage_dtype): "auto" is fp16 for one sequence on a model the native stack runs in fp32 on
    an AVX512 CPU -- its attention widens fp16 in registers as it loads, and decode streams half the bytes -- and
    the activations' dtype elsewhere. (On AVX2 the stack widens each chunk into a tile first, which costs more than
    the bytes save: docs/kv-cache.md "The float cache in 2 bytes".)"""
    if spec.dtype != "auto":
        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype], False
    if (peek(model).forward == "native" and compute_dtype(model) == torch.float32
            and cpu.isa() in ("avx512", "amx")):
        return torch.float16, True
    return None, False
