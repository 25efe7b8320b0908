"""Which dtypes the engine runs in: one for the activations (compute), one for stored Linear weights.

Decode is memory-bound: a step reads every weight once, so 2-byte weights halve its cost on any machine. Prefill is
compute-bound, and there the CPU decides: without AVX512-BF16/AMX (e.g. AMD Zen 3, AVX2 only) torch's bf16 and
fp16 matmuls run one row at a time — a 128-token prefill in bf16 is ~6x slower than in fp32 — and bf16 attention
and elementwise ops are slower than fp32 too. So `auto` means:

- CUDA: bf16 activations and bf16 weights.
- any CPU: fp32 activations and fp16 weights. `HalfStorageLinear` runs 1-3-row products (decode) through
  the half-precision kernel (fbgemm's packed fp16 GEMM on x86), which reads half the bytes (fp16's kernel streams
  faster than bf16's here, and fp16 keeps 3 more mantissa bits of the fp32 original), and upcasts the weight to
  fp32 for 4+ rows (prefill).
- That includes CPUs with native bf16 (AVX512-BF16/AMX): there bf16 prefills faster, but a bf16 decode step goes
  through torch's per-operator bf16 path and is 2.5-3x slower (measured on a 2-core EPYC with AVX512-BF16,
  SmolLM2-135M, `specquant bench prompt_tokens=128|512 new_tokens=64`: decode 51.6 / 42.4 tok/s in fp32 + fp16
  weights against 16.3 / 17.3 in bf16; TTFT 207 / 1064 ms against 201 / 579 ms). Decode dominates any answer
  longer than a few tokens, so `auto` picks fp32 + fp16 there too; `engine.dtype=bf16` for prompt-bound work.
- a model whose low-bit layers run specquant's own GEMMs (int4 / int8 checkpoints on an x86 CPU): the same fp32
  activations and fp16 weights. Those GEMMs and the native int4 decoder (toolkit/engine/native_decoder.py)
  compute in fp32; bf16 activations would leave them for torch's per-operator path (measured on a CPU with
  AVX512-BF16, SmolLM2-135M RTN int4 g64, one decode step: 8.3 ms native in fp32 against 19.5 ms in bf16).
"""

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toolkit import cpu
from toolkit.errors import InputError
from toolkit.model_state import peek, state_of
from toolkit.passes import (  # noqa: F401 (re-exported: the engine's names for them)
    BF16_DEQUANT_MIN_ROWS,
    BF16_PREFILL_MIN_ROWS,
    Pass,
    bf16_prefill,
    bf16_prompt_rows,
    exact_linears,
)
from toolkit.quant import bf16_native

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# Below this many rows the half-precision kernel (a gemv) wins; from it on, upcasting to fp32 wins (measured on
# Zen 3 for a 1536x576 bf16 weight: 1 row 98 vs 189 us, 4 rows 368 vs 352 us, 128 rows 11.5 vs 1.75 ms).
UPCAST_MIN_ROWS = 4

# engine.gemm=fbgemm|auto: below this many rows fp16-stored layers run fbgemm's packed fp16 GEMM (see
# pack_fbgemm_fp16), from it on the wide path above. Measured on Zen 3, 2 threads, 1536x576 fp16 weight, median us
# per call (`python benchmarks/engine_fbgemm.py` prints this table; other jobs were intermittently running):
#     rows                 1    2    4    9   16   64  128  256  2048
#     wide fp32 F.linear  81  156  209  299  287  823 1426 2642 50342
#     fbgemm fp16         43   48   63  110  177  625 1220 2418 42696
#     torch fp16 gemv    ~80  159    -    -    -    -    -    -     -
# fbgemm wins most where speculative verify and batched serving live (2-16 rows: 1.6-3.3x); past a few hundred rows
# (prefill) the two are within noise, and the wide path keeps prefill numerics what they were.
FBGEMM_MAX_ROWS = 256

PREFILL_DTYPES = ("auto", "fp32", "bf16")


def cpu_flags() -> frozenset[str]:
    return cpu.flags()


def cpu_has_native_bf16() -> bool:
    return cpu.native_bf16()


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype  # activations, KV cache, norms
    weights: torch.dtype  # stored Linear weights (and a tied embedding)
    prefill: str = "fp32"  # "bf16": prompt passes' products in bf16 (what prepare_model resolved; see bf16_prefill)
    dot: str = "fp32"  # engine.native_dot: "bf16" (a float stack's bf16 dot products) or "int8" (int4 x int8 activations)

    @property
    def name(self) -> str:
        compute, weights = DTYPE_NAMES[self.compute], DTYPE_NAMES[self.weights]
        name = compute if compute == weights else f"{weights} w / {compute} a"  # weights / activations
        return (name + (", bf16 prefill" if self.prefill == "bf16" else "")
                + (", bf16 native products" + (" on AMX" if _on_amx() else "") if self.dot == "bf16" else "")
                + (", int8 activations" if self.dot == "int8" else ""))


def runs_int8_activations(model) -> bool:
    """Whether `model` was prepared at engine.native_dot=int8 (its int4 products take int8 activations, on the
    native stack only: evaluation runs it there, docs/engine.md)."""
    precision = peek(model).precision
    return precision is not None and precision.dot == "int8"


def _on_amx() -> bool:

    return bf16_native.amx_in_use()


def _dtype(name: str, key: str) -> torch.dtype:
    if name not in DTYPES:
        raise InputError(f"unknown {key} {name!r}", f"use {key}=auto or one of: fp32, bf16, fp16")
    return DTYPES[name]


def resolve_precision(dtype: str = "auto", weight_dtype: str = "auto", device: str = "cpu") -> Precision:
    """`dtype` names the activations; `weight_dtype` the stored weights (auto: as the module docstring says: bf16
    on CUDA, fp32 activations with fp16 weights on any CPU, whatever its bf16 support or the model's kernels)."""
    if dtype == "auto":
        gpu = device != "cpu"
        compute, default_weights = (torch.bfloat16, torch.bfloat16) if gpu else (torch.float32, torch.float16)
    else:
        compute = default_weights = _dtype(dtype, "engine.dtype")
    weights = default_weights if weight_dtype == "auto" else _dtype(weight_dtype, "engine.weight_dtype")
    return Precision(compute, weights)


def _native_matmul(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype == torch.float32 or device.type != "cpu" or (dtype == torch.bfloat16 and cpu_has_native_bf16())


class HalfStorageLinear(torch.nn.Linear):
    """nn.Linear whose weight is stored in a half dtype while activations may be wider. Swapped in by class, so
    parameters, their ties and state-dict names stay the module's own.

    fp16's range ends at 65504. Checking every product for overflow costs more than a fifth of a decode step, so
    the engine checks the logits once per forward instead (an overflow anywhere turns them inf/nan) and reruns that
    forward under `exact_linears`, which takes the wide path everywhere.

    The wide path upcasts the weight on every call unless `prepare_model` gave the layer a `wide_weight` (an exact
    fp32 copy of the half weight, so results are identical either way). Upcasting costs little against a 128-row
    prefill but dominates a few-row product: a speculative verify of 5-9 rows, or the output head (49152 x 576 on
    SmolLM2) under any multi-row pass. The copy is a buffer, not a parameter: decode never reads it, so it is not
    counted in the bytes a decode step moves."""

    fbgemm_max_rows = 0  # products of fewer rows run fbgemm's packed fp16 GEMM, when the layer has one

    def bf16_product(self, x: torch.Tensor, rows: int) -> torch.Tensor | None:
        """The product in bf16 (fp32 accumulation, fp32 result) inside `bf16_prefill()` for a layer that holds a
        bf16 copy of its weight (`prepare_model(..., prefill="bf16")`) and at least BF16_PREFILL_MIN_ROWS fp32 rows;
        else None. Not exact: x and the weight are rounded to bf16's 8 significant bits."""
        if not bf16_prompt_rows(rows):  # the class flags first: every lean product asks (module lookups cost more)
            return None
        weight = getattr(self, "bf16_weight", None)
        if weight is None or x.dtype != torch.float32:
            return None
        y = F.linear(x.to(torch.bfloat16), weight).to(torch.float32)
        return y if self.bias is None else y + self.bias

    def fbgemm_product(self, x: torch.Tensor, rows: int) -> torch.Tensor | None:
        """The product through fbgemm's packed fp16 GEMM when this layer has a pack and `x` is few fp32 rows, else
        None. fp16 weights widened in registers, fp32 activations and accumulation: the wide path's arithmetic. The
        lean forward calls this directly (engine/lean_forward.py), skipping the module call."""
        packed = getattr(self, "fbgemm_fp16", None)
        if packed is not None and rows < self.fbgemm_max_rows and x.dtype == torch.float32:
            return torch.ops.quantized.linear_dynamic_fp16(x, packed)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        y = self.bf16_product(x, rows)
        if y is None:
            y = self.fbgemm_product(x, rows)
        if y is not None:
            return y
        if rows < UPCAST_MIN_ROWS and not Pass.exact:
            y = F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
            return y if self.bias is None else y + self.bias
        compute = torch.float32 if x.dtype != torch.float32 and not _native_matmul(x.dtype, x.device) else x.dtype
        bias = None if self.bias is None else self.bias.to(compute)
        wide = getattr(self, "wide_weight", None)
        weight = wide if wide is not None and wide.dtype == compute else self.weight.to(compute)
        return F.linear(x.to(compute), weight, bias).to(x.dtype)


def prefill_runs_bf16(model) -> bool:
    """Whether `model`'s prompt passes run bf16 products (what `prepare_model`'s `prefill` resolved to)."""
    precision = peek(model).precision
    return precision is not None and precision.prefill == "bf16"


def may_overflow(model) -> bool:
    """True when the model's half-precision path can overflow (fp16 weights under wider activations)."""
    precision = peek(model).precision
    return precision is not None and precision.weights == torch.float16 and precision.compute != torch.float16


def overflowed(model, logits: torch.Tensor) -> bool:
    """Whether a call of `model` (`may_overflow`) produced a non-finite logit, and so must be redone exactly. Any
    inf or NaN makes the sum non-finite, and the sum costs a fraction of a full isfinite (a 6 x 49152 verify pass:
    18 against 298 us here); a sum overflowing on finite logits would only redo the call."""
    return may_overflow(model) and not bool(logits.sum().isfinite())


GEMMS = ("auto", "fbgemm", "torch")


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def pack_fbgemm_fp16(module: torch.nn.Linear, max_rows: int) -> None:
    """Give a fp16-stored Linear fbgemm's packed fp16 copy of its weight (2 bytes per weight) for products of fewer
    than `max_rows` rows. fbgemm widens the fp16 weight to fp32 in registers and multiplies fp32 activations with
    fp32 accumulation, so its results are the wide path's up to summation order; its small-row kernel is what wins:
    see FBGEMM_MAX_ROWS."""
    bias = None if module.bias is None else module.bias.detach().float()
    module.fbgemm_fp16 = torch.ops.quantized.linear_prepack_fp16(module.weight.detach().float(), bias)
    module.fbgemm_max_rows = max_rows


def _cast_output(dtype):
    def hook(module, inputs, output):
        return output.to(dtype)
    hook.casts_to = dtype  # what the hook does, for code that reads the module's output without calling it
    return hook


def wide_copy_fits(model: torch.nn.Module, share: float = 0.25) -> bool:
    """True when fp32 copies of the model's Linear weights would take under `share` of the available memory."""
    import psutil

    extra = sum(m.weight.numel() * 4 for m in model.modules() if type(m) is torch.nn.Linear)
    return extra < share * psutil.virtual_memory().available


def resolve_prefill(prefill: str, precision: Precision, device: torch.device) -> str:
    """"bf16" or "fp32": the products of a prompt pass (see BF16_PREFILL_MIN_ROWS). bf16 applies to fp16- or
    bf16-stored weights under fp32 activations on a CPU; auto picks it where the CPU multiplies bf16 natively."""
    if prefill not in PREFILL_DTYPES:
        raise InputError(f"unknown engine.prefill_dtype {prefill!r}", f"use one of {', '.join(PREFILL_DTYPES)}")
    applies = (device.type == "cpu" and precision.compute == torch.float32
               and precision.weights in (torch.float16, torch.bfloat16))
    if prefill == "bf16" and applies and not cpu_has_native_bf16():
        raise InputError("engine.prefill_dtype=bf16 but this CPU has no native bf16 (AVX512-BF16 or AMX): its bf16 "
                         "products would run several times slower than fp32",
                         "use engine.prefill_dtype=auto or fp32")
    if prefill == "auto":
        return "bf16" if applies and cpu_has_native_bf16() else "fp32"
    return "bf16" if prefill == "bf16" and applies else "fp32"


def prepare_model(model: torch.nn.Module, precision: Precision | torch.dtype,
                  wide_copy: bool | str = False, gemm: str = "torch", prefill: str = "fp32") -> torch.nn.Module:
    """Cast `model` in place for inference at `precision` (a bare dtype means that dtype for both); returns it.
    `wide_copy` (True, False or "auto" = when it fits in a quarter of the free memory): half-stored Linear layers also
    keep an fp32 copy of their weight for multi-row products (see HalfStorageLinear). `gemm`: "fbgemm" (or "auto"
    where fbgemm is built in) runs fp16-stored layers under fp32 activations through fbgemm's packed fp16 GEMM for
    products under FBGEMM_MAX_ROWS rows; "torch" keeps torch's kernels only. `prefill` ("fp32", "bf16" or "auto",
    see `resolve_prefill`): with bf16, half-stored layers also keep a bf16 copy of their weight (2 bytes per weight)
    for prompt passes (`bf16_prefill`)."""
    if gemm not in GEMMS:
        raise InputError(f"unknown engine.gemm {gemm!r}", f"use one of {', '.join(GEMMS)}")
    if gemm == "fbgemm" and not fbgemm_available():
        raise InputError("engine.gemm=fbgemm but this torch has no fbgemm", "use engine.gemm=auto or torch")
    if isinstance(precision, torch.dtype):
        precision = Precision(precision, precision)
    # Parameters only: buffers keep their dtype (rotary frequencies stay fp32; quantized layers keep the scale
    # dtypes their kernels need).
    for param in model.parameters():
        param.data = param.data.to(precision.compute)
    model.eval()
    device = next(model.parameters()).device
    swap = precision.weights != precision.compute or not _native_matmul(precision.weights, device)
    prefill = resolve_prefill(prefill, precision, device) if swap else "fp32"
    if swap:
        # the dtype the wide path computes in (see HalfStorageLinear.forward); GPUs keep their memory
        wide = None if device.type != "cpu" else (
            precision.compute if _native_matmul(precision.compute, device) else torch.float32)
        use_fbgemm = (gemm != "torch" and fbgemm_available() and device.type == "cpu"
                      and precision.weights == torch.float16 and precision.compute == torch.float32)
        if wide_copy == "auto":
            wide_copy = wide_copy_fits(model)
        # a prompt pass keeps only its last position's logits (one row): the output head needs no bf16 copy
        head = model.get_output_embeddings()
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                module.weight.data = module.weight.data.to(precision.weights)
                module.__class__ = HalfStorageLinear
                if use_fbgemm:
                    pack_fbgemm_fp16(module, FBGEMM_MAX_ROWS)
                if wide_copy and wide is not None:
                    module.register_buffer("wide_weight", module.weight.data.to(wide), persistent=False)
                if prefill == "bf16" and module is not head:  # through fp32: torch's fp16 -> bf16 cast is a scalar loop
                    module.register_buffer("bf16_weight", module.weight.data.float().to(torch.bfloat16),
                                           persistent=False)
    embedding = model.get_input_embeddings()
    if embedding.weight.dtype != precision.compute:  # tied to a half-precision output head
        embedding.register_forward_hook(_cast_output(precision.compute))
    if prefill == "bf16":  # quantized layers' dequantize path (QuantLinear.prefill_bf16)
        for module in model.modules():
            if hasattr(type(module), "prefill_bf16"):
                module.prefill_bf16 = True
    state_of(model).precision = dataclasses.replace(precision, prefill=prefill)
    return model


def model_precision(model) -> Precision:
    """What prepare_model set, else the parameters' dtype for both."""
    found = peek(model).precision
    if found is None:
        dtype = next(model.parameters()).dtype
        found = Precision(dtype, dtype)
    return found
